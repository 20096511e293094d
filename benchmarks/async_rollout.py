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
- http keep-alive / http new connection: the requests through `/generate` against the engine's server on
  127.0.0.1, all at once (one coroutine per request: `--prompts` x `--samples` concurrent clients) from a
  client process of their own (clients in the server's process would share its interpreter lock), over
  kept-alive connections or a new connection per request (`Connection: close`); against the same requests
  submitted in process at once (tokens/s of each);
- http overhead: one 1-token request over HTTP minus the same request in process (each median of
  `--probes` sequential requests, the HTTP ones from the client process), kept-alive and new connection.
Prints one line per contender and one greppable summary; medians, ratios and raw samples go to JSON."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import multiprocessing
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


def generate_bodies(requests) -> list[dict]:
    """The `/generate` bodies of the requests: the same prompts, budgets and temperature, EOS ignored as in
    process (so every contender makes the same tokens count); the seed is the server's (an int below 2**63,
    which keys its own stream: the tokens differ from the in-process ones, their number does not)."""
    return [
        {"prompt_ids": prompt, "sample": sample, "sampling_params": {
            "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "ignore_eos": True,
            "seed": sampling.seed[0] % 2**63}}
        for prompt, sampling, sample in requests
    ]  # fmt: skip


def concurrent_clients_s(url: str, bodies: list[dict], keep_alive: bool) -> float:
    """(In the client process.) Every body posted at once, one coroutine each; seconds to the last reply."""

    async def post_all() -> float:
        limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
        headers = {} if keep_alive else {"Connection": "close"}
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, headers=headers) as client:
            started = time.perf_counter()
            replies = await asyncio.gather(*(client.post("/generate", json=body) for body in bodies))
            elapsed = time.perf_counter() - started
        _check_replies(replies)
        return elapsed

    return asyncio.run(post_all())


def sequential_requests_ms(url: str, body: dict, probes: int, keep_alive: bool) -> list[float]:
    """(In the client process.) Milliseconds of each of `probes` requests sent one after another."""
    headers = {} if keep_alive else {"Connection": "close"}
    times = []
    with httpx.Client(base_url=url, timeout=600, headers=headers) as client:
        for _ in range(probes):
            started = time.perf_counter()
            reply = client.post("/generate", json=body)
            times.append((time.perf_counter() - started) * 1e3)
            _check_replies([reply])
    return times


def _check_replies(replies) -> None:
    bad = [reply for reply in replies if reply.status_code != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} HTTP requests failed, the first: {bad[0].status_code} {bad[0].text}")


def run_in_process(engine, requests) -> float:
    started = time.perf_counter()
    handles = [engine.submit(p, s, sample=i) for p, s, i in requests]
    for handle in handles:
        handle.result()
    return time.perf_counter() - started


ONE_TOKEN_PROMPT = [5, 6, 7]


def in_process_requests_ms(engine, probes: int) -> list[float]:
    """Milliseconds of each of `probes` 1-token greedy requests submitted one after another in process."""
    one = SamplingConfig(max_new_tokens=1, eos_token_id=[])
    times = []
    for _ in range(probes):
        started = time.perf_counter()
        engine.submit(ONE_TOKEN_PROMPT, one).result()
        times.append((time.perf_counter() - started) * 1e3)
    return times


def http_overheads_ms(engine, url: str, clients, probes: int) -> dict[str, list[float]]:
    """Per repeat: the median HTTP request minus the median in-process one, kept-alive and new connection."""
    body = {"prompt_ids": ONE_TOKEN_PROMPT, "sampling_params": {"max_tokens": 1, "temperature": 0, "ignore_eos": True}}
    local = statistics.median(in_process_requests_ms(engine, probes))
    return {
        name: statistics.median(clients.submit(sequential_requests_ms, url, body, probes, keep_alive).result()) - local
        for name, keep_alive in (("keep_alive", True), ("new_connection", False))
    }


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
    rows, bodies = len(requests), generate_bodies(requests)
    names = ("batch", "staggered", "staggered+aborts", "http_keep_alive", "http_new_connection", "in_process")
    times: dict[str, list[float]] = {name: [] for name in names}
    overheads: dict[str, list[float]] = {"keep_alive": [], "new_connection": []}
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter, with its own interpreter lock
    with (
        AsyncEngine(model, max_batch=rows, max_model_len=args.longest + args.new_tokens) as engine,
        engine.serve() as server,
        concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as clients,
    ):
        run_in_process(engine, requests[:2])  # warm-up, of the client process too
        clients.submit(concurrent_clients_s, server.url, bodies[:2], True).result()
        for _ in range(args.repeats):
            times["batch"].append(run_batch(rollout, prompts, sampling, args.samples))
            times["staggered"].append(run_staggered(engine, requests, args.gap_ms))
            times["staggered+aborts"].append(run_staggered(engine, requests, args.gap_ms, abort_every=3))
            for name, keep_alive in (("http_keep_alive", True), ("http_new_connection", False)):
                times[name].append(clients.submit(concurrent_clients_s, server.url, bodies, keep_alive).result())
            times["in_process"].append(run_in_process(engine, requests))
            for name, value in http_overheads_ms(engine, server.url, clients, args.probes).items():
                overheads[name].append(value)
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "model": args.model, "requests": rows, "new_tokens": args.new_tokens, "medians_s": medians,
        "staggered_over_batch": medians["staggered"] / medians["batch"],
        "aborts_over_batch": medians["staggered+aborts"] / medians["batch"],
        # the same tokens on every contender: a tokens/s ratio is the inverse time ratio
        "http_keep_alive_tokens_per_s_over_in_process": medians["in_process"] / medians["http_keep_alive"],
        "http_new_connection_tokens_per_s_over_in_process": medians["in_process"] / medians["http_new_connection"],
        "http_overhead_ms_median": {name: statistics.median(values) for name, values in overheads.items()},
        "raw_s": times, "raw_overhead_ms": overheads,
    }  # fmt: skip
    for name, value in medians.items():
        print(f"{name}: {value * 1e3:.1f} ms")
    overhead = result["http_overhead_ms_median"]
    print(f"async_rollout {args.model}: staggered/batch {result['staggered_over_batch']:.3f}, "
          f"aborts/batch {result['aborts_over_batch']:.3f}, http/in-process tokens/s "
          f"{result['http_keep_alive_tokens_per_s_over_in_process']:.3f} keep-alive, "
          f"{result['http_new_connection_tokens_per_s_over_in_process']:.3f} new connection; http overhead "
          f"{overhead['keep_alive']:.2f} ms keep-alive, {overhead['new_connection']:.2f} ms new connection")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
