"""Cascade decode attention alone: a GRPO-like step's shared prompts, their K/V from DRAM and from cache.

    taskset -c 0 python benchmarks/kernels/cascade_attention.py --repeats 15 --out results/cascade_attention.json

The case of `attention_ab.py`'s cascade (64 rows reading 8 prompts' one shared copy of K/V, 108-856 keys,
bench-qwen2's 4 query heads over 2 K/V heads of 64, 4 layers' calls of `invariant_attention_shared`),
in three forms: each row then 32 keys of its own (a step halfway through a 64-token completion), then
one, and the prompts cut to whole 64-key blocks with one own key (the group tiles alone, no partial
block). Each form runs "flushed" (a 64 MB write before every timed call, as after a step's weights have
streamed through; the three forms interleaved) and "warm" (one form's calls back to back).
FLOPs count 4 x head_dim per (row, query head, key): q.k and the P.V. Medians, GFLOPS, raw samples to
JSON. To compare two versions of the kernel, use `attention_ab.py`; `perf record -e cpu-clock` over a
run of this script splits the time by kernel function."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from attention_ab import CASCADE_OWN, CASCADE_PROMPTS, CASCADE_SAMPLES
from decode_attention import HEAD_DIM, HEADS, KV_HEADS
from interleave import interleaved

from autobucket.engine.kernels.library import load_invariant_kernels

BLOCK_KEYS = 64  # the kernel's softmax block (kBlockKeys)


def cascade_steps(prompts: tuple[int, ...], own: int, layers: int) -> list[tuple]:
    """Per layer the op's arguments: rows' query, own K/V and mask, the shared K/V, lengths and groups."""
    generator = torch.Generator().manual_seed(len(prompts) + own)
    groups, rows = len(prompts), len(prompts) * CASCADE_SAMPLES
    row_group = torch.arange(groups).repeat_interleave(CASCADE_SAMPLES)
    steps = []
    for _ in range(layers):
        shared_key, shared_value = (
            torch.randn(groups, KV_HEADS, max(prompts), HEAD_DIM, generator=generator) for _ in range(2)
        )
        key, value = (torch.randn(rows, KV_HEADS, own, HEAD_DIM, generator=generator) for _ in range(2))
        query = torch.randn(rows, HEADS, 1, HEAD_DIM, generator=generator)
        allowed = torch.ones(rows, 1, own, dtype=torch.bool)
        steps.append((query, key, value, allowed, shared_key, shared_value, torch.tensor(prompts), row_group))
    return steps


def attend(steps: list[tuple]):
    def run() -> list[torch.Tensor]:
        return [
            torch.ops.autobucket.invariant_attention_shared(q, k, v, a, HEAD_DIM**-0.5, sk, sv, lengths, groups)
            for q, k, v, a, sk, sv, lengths, groups in steps
        ]

    return run


def step_flops(prompts: tuple[int, ...], own: int, layers: int) -> float:
    keys = sum(length + own for length in prompts) * CASCADE_SAMPLES
    return 4.0 * HEAD_DIM * HEADS * keys * layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="results/cascade_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_invariant_kernels()
    whole_blocks = tuple(length // BLOCK_KEYS * BLOCK_KEYS for length in CASCADE_PROMPTS)
    forms = {
        f"prompt + {CASCADE_OWN} own keys": (CASCADE_PROMPTS, CASCADE_OWN),
        "prompt + 1 own key": (CASCADE_PROMPTS, 1),
        "whole blocks + 1 own key": (whole_blocks, 1),
    }
    functions = {name: attend(cascade_steps(prompts, own, args.layers)) for name, (prompts, own) in forms.items()}
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    # warm: each form's calls back to back (interleaved, the three forms' 28 MB each would evict one another)
    warm = {name: interleaved({name: function}, args.repeats)[name] for name, function in functions.items()}
    samples = {"flushed": interleaved(functions, args.repeats, before=lambda: flush.fill_(1)), "warm": warm}
    results = []
    for name, (prompts, own) in forms.items():
        flops = step_flops(prompts, own, args.layers)
        medians = {mode: statistics.median(samples[mode][name]) for mode in samples}
        rates = {mode: flops / ms / 1e6 for mode, ms in medians.items()}
        print(f"{name}: flushed {medians['flushed']:.2f} ms ({rates['flushed']:.1f} GFLOPS), "
              f"warm {medians['warm']:.2f} ms ({rates['warm']:.1f} GFLOPS)")  # fmt: skip
        results.append({"form": name, "prompts": list(prompts), "own_keys": own, "layers": args.layers,
                        "gflop": flops / 1e9, "medians_ms": medians, "gflops": rates,
                        "samples_ms": {mode: samples[mode][name] for mode in samples}})  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
