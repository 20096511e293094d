"""The asynchronous engine against one batch call, and its HTTP server against the engine in process.

    python benchmarks/async_rollout.py --model bench-qwen2 --repeats 5 --out results/async_rollout.json
    python benchmarks/async_rollout.py --model tiny-qwen2 --prompts 2 --samples 2 --new-tokens 4 --repeats 1   # smoke

Workload: GRPO-shaped, `--prompts` prompts x `--samples` samples (temperature 1.0, `--new-tokens` new tokens,
EOS off so every contender makes the same number of tokens). Contenders, interleaved in each repeat:
- batch: one `Rollout.generate(prompts, n=samples)` call (the synchronous baseline);
- staggered: the same requests submitted to an `AsyncEngine` at Poisson arrival times (mean gap
  `--gap-ms`), timed from the first submission to the last result;
- staggered+aborts: as staggered, with every third request aborted after a quarter of its tokens and
  resubmitted with its tokens so far (`generated=`);
- http: the requests through `/generate` from one thread per request against the engine's server on
  127.0.0.1, against the same requests submitted in process at once (tokens/s of each);
- http overhead: one 1-token request over HTTP minus in process, per request (median of `--probes`).
Prints one line per contender and one greppable summary; medians, ratios and raw samples go to JSON."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.sampling.streams import request_seeds
from autobucket.models import build_tiny_model
from autobucket.prompts import random_prompts
from autobucket.serving import AsyncEngine


def workload(args) -> tuple[list[list[int]], SamplingConfig]:
    lengths = [random.Random(i).randint(16, args.longest) for i in range(args.prompts)]
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, seed=0, eos_token_id=[])
    return random_prompts(lengths, 1024, seed=0), sampling


def requests_of(prompts, sampling, samples):
    """(prompt, per-request sampling, sample index) per request, keyed as Rollout.generate's n samples are."""
    seeds = request_seeds(sampling.seed, len(prompts))  # prompt i's stream key in the batch call
    return [(p, dataclasses.replace(sampling, seed=[seeds[i]]), s) for i, p in enumerate(prompts) for s in range(samples)]


def run_batch(rollout, prompts, sampling, samples) -> float:
    started = time.perf_counter()
    rollout.generate(prompts, dataclasses.replace(sampling, n=samples, continuous_batch_size=len(prompts) * samples))
    return time.perf_counter() - started


def run_staggered(engine, requests, gap_ms: float, abort_every: int = 0) -> float:
    rng = random.Random(1)
    started = time.perf_counter()
    handles = []
    for index, (prompt, sampling, sample) in enumerate(requests):
        time.sleep(rng.expovariate(1000.0 / gap_ms) if gap_ms else 0.0)
        handles.append((engine.submit(prompt, sampling, sample=sample), index))
    for handle, index in handles:
        if abort_every and index % abort_every == 0:
            prompt, sampling, sample = requests[index]
            _wait_tokens(handle, max(1, sampling.max_new_tokens // 4))
            handle.abort()
            partial = handle.result().tokens
            left = sampling.max_new_tokens - len(partial)
            if left:
                rest = dataclasses.replace(sampling, max_new_tokens=left)
                engine.submit(prompt, rest, sample=sample, generated=partial).result()
        else:
            handle.result()
    return time.perf_counter() - started


def _wait_tokens(handle, count: int) -> None:
    for _ in handle.stream():
        if len(handle.snapshot().tokens) >= count:
            return


def run_http(url: str, requests) -> float:
    def post(request):
        prompt, sampling, sample = request
        body = {"prompt_ids": prompt, "sample": sample, "sampling_params": {
            "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "seed": sampling.seed[0]}}
        return httpx.post(f"{url}/generate", json=body, timeout=600).json()

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        list(pool.map(post, requests))
    return time.perf_counter() - started


def run_in_process(engine, requests) -> float:
    started = time.perf_counter()
    handles = [engine.submit(p, s, sample=i) for p, s, i in requests]
    for handle in handles:
        handle.result()
    return time.perf_counter() - started


def http_overhead_ms(engine, url: str, probes: int) -> list[float]:
    one = SamplingConfig(max_new_tokens=1, eos_token_id=[])
    samples = []
    for _ in range(probes):
        started = time.perf_counter()
        engine.submit([5, 6, 7], one).result()
        local = time.perf_counter() - started
        started = time.perf_counter()
        httpx.post(f"{url}/generate", json={"prompt_ids": [5, 6, 7], "sampling_params": {"max_tokens": 1}})
        samples.append((time.perf_counter() - started - local) * 1e3)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-qwen2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--longest", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gap-ms", type=float, default=5.0, help="mean Poisson gap between arrivals")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = build_tiny_model(args.model)
    prompts, sampling = workload(args)
    requests = requests_of(prompts, sampling, args.samples)
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    rows = len(requests)
    times: dict[str, list[float]] = {name: [] for name in ("batch", "staggered", "staggered+aborts", "http", "in_process")}
    with AsyncEngine(model, max_batch=rows, max_model_len=args.longest + args.new_tokens) as engine, engine.serve() as server:
        run_in_process(engine, requests[:2])  # warm-up
        for _ in range(args.repeats):
            times["batch"].append(run_batch(rollout, prompts, sampling, args.samples))
            times["staggered"].append(run_staggered(engine, requests, args.gap_ms))
            times["staggered+aborts"].append(run_staggered(engine, requests, args.gap_ms, abort_every=3))
            times["http"].append(run_http(server.url, requests))
            times["in_process"].append(run_in_process(engine, requests))
        overhead = http_overhead_ms(engine, server.url, args.probes)
    medians = {name: statistics.median(values) for name, values in times.items()}
    tokens = rows * args.new_tokens
    result = {
        "model": args.model, "requests": rows, "new_tokens": args.new_tokens, "medians_s": medians,
        "staggered_over_batch": medians["staggered"] / medians["batch"],
        "aborts_over_batch": medians["staggered+aborts"] / medians["batch"],
        "http_tokens_per_s_over_in_process": (tokens / medians["http"]) / (tokens / medians["in_process"]),
        "http_overhead_ms_median": statistics.median(overhead), "raw_s": times, "raw_overhead_ms": overhead,
    }  # fmt: skip
    for name, value in medians.items():
        print(f"{name}: {value * 1e3:.1f} ms")
    print(f"async_rollout {args.model}: staggered/batch {result['staggered_over_batch']:.3f}, "
          f"aborts/batch {result['aborts_over_batch']:.3f}, http/in-process tokens/s "
          f"{result['http_tokens_per_s_over_in_process']:.3f}, http overhead {result['http_overhead_ms_median']:.2f} ms")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
