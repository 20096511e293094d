"""Whole calls with the direct decode step against the same calls through the model's own forward.

    quiet-run -- .venv/bin/python benchmarks/studies/direct_decode.py --out results/direct_decode.json

The direct step (`engine/decode/step.py`) runs a Llama-family model's decode step from its
parts, bitwise the model's forward, without transformers' per-layer Python. Contenders: Auto with
`kernels="invariant"` and with the default kernels, each with the direct step ("direct") and through the
model's forward ("model"), on bench-qwen2 (4 layers) at bench-peers' workloads (32 prompts x 16 new
tokens, greedy, EOS off) and on SmolLM2-135M (30 layers; 16 prompts of 32-160 tokens x 32 new tokens).
Each round runs the two forms of a kernel set back to back in alternating order (ABBA), so an order
effect (the second of two identical contenders is often faster here) cancels; medians of the rounds,
the ratio direct / model and its range over rounds. Every pair's tokens must be equal. Raw samples to
JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.calibration_file import host_cpu
from autobucket.engine.decode.parts import LlamaParts
from autobucket.models import build_tiny_model, load_model
from autobucket.prompts import random_prompts
from autobucket.tools.workloads import Workload, reference_workloads

DIRECT_OF = LlamaParts.of


def set_direct(on: bool) -> None:
    """The direct step on (as shipped) or off (every decode step through the model's forward)."""
    LlamaParts.of = DIRECT_OF if on else classmethod(lambda cls, model: None)


def timed_call(rollout: Rollout, prompts, sampling, direct: bool) -> tuple[float, list]:
    set_direct(direct)
    try:
        started = time.perf_counter()
        tokens = rollout.generate(prompts, sampling).tokens
        return (time.perf_counter() - started) * 1e3, tokens
    finally:
        set_direct(True)


def measure(rollout: Rollout, prompts, sampling, rounds: int) -> dict:
    samples: dict[str, list[float]] = {"direct": [], "model": []}
    for direct in (True, False):  # warm-up
        timed_call(rollout, prompts, sampling, direct)
    equal = True
    for index in range(rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        tokens = {}
        for direct in order:
            ms, tokens[direct] = timed_call(rollout, prompts, sampling, direct)
            samples["direct" if direct else "model"].append(ms)
        equal = equal and tokens[True] == tokens[False]
    ratios = [a / b for a, b in zip(samples["direct"], samples["model"], strict=True)]
    return {"samples_ms": samples, "median_ms": {k: statistics.median(v) for k, v in samples.items()},
            "ratio": statistics.median(samples["direct"]) / statistics.median(samples["model"]),
            "round_ratios": ratios, "tokens_equal": equal}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument("--out", default="results/direct_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = []
    bench = build_tiny_model("bench-qwen2")
    workloads = [*reference_workloads(), Workload("uniform short (32x16)", (16,) * 32)]
    for workload in workloads:
        prompts = random_prompts(workload.lengths, bench.config.vocab_size, seed=0)
        cases.append(("bench-qwen2", bench, workload.name, prompts, SamplingConfig(max_new_tokens=16, continuous_batch_size=32, eos_token_id=[])))
    if not args.skip_smollm2:
        smollm2, _ = load_model("smollm2")
        prompts = random_prompts([32 + 8 * i for i in range(16)], smollm2.config.vocab_size, seed=1)
        cases.append(("smollm2", smollm2, "16 prompts of 32-152 tokens x 32", prompts,
                      SamplingConfig(max_new_tokens=32, continuous_batch_size=16, eos_token_id=[])))
    rows = []
    print(f"{host_cpu()}; medians of {args.rounds} ABBA rounds, one thread")
    print("| model | workload | kernels | direct ms | model ms | direct / model | by round |")
    print("|---|---|---|---:|---:|---:|---|")
    for model_name, model, workload, prompts, sampling in cases:
        for kernels in ("invariant", "torch"):
            rollout = Rollout(model, config=RolloutConfig(route="auto", kernels=kernels))
            result = measure(rollout, prompts, sampling, args.rounds)
            rows.append({"model": model_name, "workload": workload, "kernels": kernels, **result})
            m = result["median_ms"]
            spread = f"{min(result['round_ratios']):.2f}-{max(result['round_ratios']):.2f}"
            flag = "" if result["tokens_equal"] else " (TOKENS DIFFER)"
            print(f"| {model_name} | {workload} | {kernels} | {m['direct']:.0f} | {m['model']:.0f} | "
                  f"{result['ratio']:.3f}{flag} | {spread} |", flush=True)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": host_cpu(), "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
