"""Where one warm `generate` call's time goes: a torch profile of a GRPO-like or a prefill-heavy call.

    taskset -c 0 python benchmarks/call_profile.py --workload grpo --kernels invariant --out results/call_profile.json

bench-qwen2, fp32 (`--dtype bfloat16`; `--logprobs` adds trainer-mode logprobs), one thread (`--threads N` for more; pin N cores). `grpo`: 8 ShareGPT-like prompts x n = 8, 64 new tokens, T = 1 (the
GRPO-like call of benchmarks/shared_decode.py); `sharegpt`: 32 ShareGPT-like prompts, 16 greedy new
tokens (the prefill-heavy workload of bench-peers); `short_tail`: bench-peers' 1 x 20 + 31 x 1 tokens,
16 greedy new tokens (decode-bound at tiny contexts). One warm-up call, `--repeats` timed calls without
the profiler (their medians are the call's time), then one call under `torch.profiler`: its top
operators by self time, with each one's share. Writes the call times, the engine's profile and the
operator table to JSON. Not a contest: it tells which kernel to work on next."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.models import build_tiny_model
from autobucket.prompts import random_prompts
from autobucket.tools.workloads import sharegpt_like_lengths


def workload(name: str, vocab: int) -> tuple[list[list[int]], SamplingConfig]:
    if name == "grpo":
        prompts = random_prompts(sharegpt_like_lengths(8, seed=1), vocab, seed=1)
        return prompts, SamplingConfig(max_new_tokens=64, eos_token_id=[], n=8, temperature=1.0, seed=0,
                                       continuous_batch_size=64)  # all 64 rows at once, as shared_decode.py runs it
    lengths = sharegpt_like_lengths(32, seed=0) if name == "sharegpt" else SHORT_TAIL
    prompts = random_prompts(lengths, vocab, seed=0)
    return prompts, SamplingConfig(max_new_tokens=16, continuous_batch_size=32, eos_token_id=[])


SHORT_TAIL = (20,) + (1,) * 31  # bench-peers' decode-bound workload: 32 rows, contexts of 2-36 keys


def top_operators(prof, count: int, by_shape: bool = False) -> list[dict]:
    events = sorted(prof.key_averages(group_by_input_shape=by_shape), key=lambda event: -event.self_cpu_time_total)
    total_us = sum(event.self_cpu_time_total for event in events)
    return [{"name": event.key, "self_ms": event.self_cpu_time_total / 1e3, "calls": event.count,
             "share": event.self_cpu_time_total / total_us,
             **({"input_shapes": event.input_shapes} if by_shape else {})} for event in events[:count]]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("grpo", "sharegpt", "short_tail"), default="grpo")
    parser.add_argument("--kernels", choices=("invariant", "torch"), default="invariant")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (pin as many cores)")
    parser.add_argument("--by-shape", action="store_true", help="one line per operator and input shapes")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the model's dtype")
    parser.add_argument("--logprobs", action="store_true", help="also trainer-mode logprobs (what RL asks for)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_tiny_model("bench-qwen2").to(getattr(torch, args.dtype))
    prompts, sampling = workload(args.workload, model.config.vocab_size)
    sampling = dataclasses.replace(sampling, logprobs=args.logprobs)
    rollout = Rollout(model, config=RolloutConfig(route="auto", kernels=args.kernels))
    rollout.generate(prompts, sampling)  # warm-up: packs, kernel library, caches
    call_ms = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        result = rollout.generate(prompts, sampling)
        call_ms.append((time.perf_counter() - started) * 1e3)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=args.by_shape) as prof:
        rollout.generate(prompts, sampling)
    operators = top_operators(prof, args.top, args.by_shape)
    print(f"{args.workload}, {args.dtype}, kernels={args.kernels}, {args.threads} thread(s): call {statistics.median(call_ms):.0f} ms (median of {args.repeats}: "
          f"{', '.join(f'{ms:.0f}' for ms in call_ms)}); route {result.profile.route}")  # fmt: skip
    for operator in operators:
        shapes = f"  {operator['input_shapes']}" if args.by_shape else ""
        print(f"  {operator['name']:<45} {operator['self_ms']:9.1f} ms  {operator['share']:6.1%}  x{operator['calls']}{shapes}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"workload": args.workload, "dtype": args.dtype, "logprobs": args.logprobs, "kernels": args.kernels, "threads": args.threads, "call_ms": call_ms,
                  "profile": result.profile.to_dict(), "top_operators": operators}  # fmt: skip
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
