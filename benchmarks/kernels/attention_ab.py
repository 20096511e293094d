"""Decode and prefill attention, this tree's kernel against a git revision's, interleaved in one process.

    taskset -c 0 python benchmarks/kernels/attention_ab.py --baseline HEAD --out results/attention_ab.json
    taskset -c 0,1 python benchmarks/kernels/attention_ab.py --baseline HEAD --threads 2   # the loops' split

On this VM the same code runs up to 25% faster or slower from one process to the next, so two builds
timed in separate processes cannot be told apart by a few percent. Here the revision's
`invariant_attention.cpp` (and the header it includes) is built beside this tree's, under its own
operator namespace, and both run the same decode step's caches in turn (`decode_attention.py`'s layout:
bench-qwen2's heads, `--layers` layers, a 64 MB write before every timed call so the cache comes from
DRAM), each build with its own default choices for this CPU; a GRPO-like step's cascade decode
(64 rows reading 8 prompts' shared K/V, then 32 columns of their own; and 8 rows reading one prompt
over a single K/V head, fewer pairs than threads); and the prefill of bench-peers'
spread workload (32 causal prompts of 16, 32, ..., 512 tokens, one call each, one layer: what Auto's
bucketed route runs per layer). The outputs must be bitwise equal (no change to the kernel may change a
value). Medians, ratios this tree / baseline, raw samples to JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from decode_attention import HEAD_DIM, HEADS, KV_HEADS, decode_layers
from revision_ab import build_revision_kernel, tree_against_baseline

from autobucket.engine.kernels.library import load_invariant_kernels

NAMESPACE = "autobucket_baseline"


_FLUSH = torch.empty(64 << 20, dtype=torch.uint8)


def flush_dram() -> None:
    """A 64 MB write, so the next call finds its cache in DRAM, as a step after the weights' stream does."""
    _FLUSH.fill_(1)


def both_builds(op_name: str) -> dict:
    """{"tree", "baseline"}: the operator `op_name` of this tree's library and of the revision's build."""
    return {
        "tree": getattr(torch.ops.autobucket, op_name),
        "baseline": getattr(getattr(torch.ops, NAMESPACE), op_name),
    }


def report(label: str, result: dict) -> None:
    m = result["medians_ms"]
    print(f"{result['dtype']} {label}: tree {m['tree']:.2f} ms, baseline {m['baseline']:.2f} ms, ratio "
          f"{result['ratio_tree_to_baseline']:.3f}; bitwise equal {result['bitwise_equal']}")  # fmt: skip


def measure(rows: int, context: int, layers: int, dtype: torch.dtype, repeats: int) -> dict:
    cache = decode_layers(rows, context, layers, dtype)
    ops = both_builds("invariant_attention")

    def attend(op):
        return lambda: [op(q, k, v, a, False, HEAD_DIM**-0.5) for q, k, v, a in cache]

    compared = tree_against_baseline(
        {name: attend(op) for name, op in ops.items()}, repeats, before=flush_dram
    )
    return {"rows": rows, "context": context, "layers": layers, "dtype": str(dtype).removeprefix("torch."),
            **compared}  # fmt: skip


# A GRPO-like step's cascade: 8 prompts (one round of benchmarks/shared_decode.py's lengths) x 8 samples, each
# sample 32 tokens into its completion
CASCADE_PROMPTS, CASCADE_SAMPLES, CASCADE_OWN = (459, 246, 856, 690, 179, 845, 108, 202), 8, 32


def measure_cascade(
    layers: int, dtype: torch.dtype, repeats: int, prompts: tuple[int, ...] = CASCADE_PROMPTS, kv_heads: int = KV_HEADS
) -> dict:
    """Cascade decode (`invariant_attention_shared`): each row reads its prompt's one shared copy of K/V,
    then its own columns; `CASCADE_SAMPLES` rows a prompt, HEADS query heads over `kv_heads` K/V heads."""
    generator = torch.Generator().manual_seed(len(prompts))
    groups, longest = len(prompts), max(prompts)
    rows = groups * CASCADE_SAMPLES
    lengths = torch.tensor(prompts)
    row_group = torch.arange(groups).repeat_interleave(CASCADE_SAMPLES)
    steps = []
    for _ in range(layers):
        shared_key, shared_value = (
            torch.randn(groups, kv_heads, longest, HEAD_DIM, generator=generator).to(dtype) for _ in range(2)
        )
        key, value = (
            torch.randn(rows, kv_heads, CASCADE_OWN, HEAD_DIM, generator=generator).to(dtype)
            for _ in range(2)
        )
        query = torch.randn(rows, HEADS, 1, HEAD_DIM, generator=generator).to(dtype)
        allowed = torch.ones(rows, 1, CASCADE_OWN, dtype=torch.bool)
        steps.append((query, key, value, allowed, shared_key, shared_value))
    ops = both_builds("invariant_attention_shared")

    def attend(op):
        return lambda: [
            op(q, k, v, a, HEAD_DIM**-0.5, sk, sv, lengths, row_group) for q, k, v, a, sk, sv in steps
        ]

    compared = tree_against_baseline(
        {name: attend(op) for name, op in ops.items()}, repeats, before=flush_dram
    )
    return {"rows": rows, "cascade_prompts": list(prompts), "kv_heads": kv_heads, "own": CASCADE_OWN,
            "layers": layers, "dtype": str(dtype).removeprefix("torch."), **compared}  # fmt: skip


SPREAD_LENGTHS = tuple(range(16, 513, 16))


def measure_spread_prefill(dtype: torch.dtype, repeats: int) -> dict:
    """Prefill attention (`invariant_attention`, causal, no mask): one call per prompt of the spread."""
    generator = torch.Generator().manual_seed(len(SPREAD_LENGTHS))
    prompts = [
        tuple(torch.randn(1, heads, length, HEAD_DIM, generator=generator).to(dtype)
              for heads in (HEADS, KV_HEADS, KV_HEADS))
        for length in SPREAD_LENGTHS
    ]  # fmt: skip
    none = torch.empty(0, dtype=torch.bool)
    ops = both_builds("invariant_attention")

    def attend(op):
        return lambda: [op(q, k, v, none, True, HEAD_DIM**-0.5) for q, k, v in prompts]

    compared = tree_against_baseline({name: attend(op) for name, op in ops.items()}, repeats)
    return {"prefill_lengths": list(SPREAD_LENGTHS), "dtype": str(dtype).removeprefix("torch."), **compared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare against (default HEAD)")
    parser.add_argument("--shapes", default="32x512,64x800", help="rows x context, comma-separated")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (pin as many cores)")
    parser.add_argument("--out", default="results/attention_ab.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_invariant_kernels()
    build_revision_kernel(args.baseline, "invariant_attention.cpp", NAMESPACE)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        result = measure_spread_prefill(dtype, args.repeats)
        report("spread prefill, 32 prompts of 16-512 tokens", result)
        results.append(result)
        result = measure_cascade(args.layers, dtype, args.repeats)
        report(f"cascade, {result['rows']} rows over 8 shared prompts", result)
        results.append(result)
        # fewer (prompt, K/V head) pairs than a many-core trainer's threads: here, one on two threads
        result = measure_cascade(args.layers, dtype, args.repeats, prompts=(856,), kv_heads=1)
        report(f"cascade, {result['rows']} rows over 1 prompt, 1 K/V head", result)
        results.append(result)
        for shape in args.shapes.split(","):
            rows, context = (int(part) for part in shape.split("x"))
            result = measure(rows, context, args.layers, dtype, args.repeats)
            report(f"rows {rows} context {context}", result)
            results.append(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    record = {"baseline": args.baseline, "threads": args.threads, "results": results}
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
