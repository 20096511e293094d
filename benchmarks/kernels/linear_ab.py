"""The fp32 fixed-order linear, this tree's kernel against a git revision's, interleaved in one process.

    taskset -c 0 python benchmarks/kernels/linear_ab.py --baseline HEAD~1 --out results/linear_ab.json

On this VM the same code runs up to 25% faster or slower from one process to the next, so two builds
timed in separate processes cannot be told apart by a few percent. Here the revision's
`fixed_order_linear.cpp` is built beside this tree's library under its own operator namespace, and
the two run in turn:
- the op alone on bench-qwen2's and SmolLM2's shapes at decode rows, its weight in cache (`warm`) or
  after a 64 MB write (`cold`);
- bench-qwen2's fp32 decode step (`--rows` x `--context`) as a rollout runs it (the decode step's kernel ops: fused
  elementwise kernels, the invariant attention), its linears on one build or the other.
Outputs must be bitwise equal (no change to the kernel may change a value). Medians, ratios this tree
/ baseline, raw samples to JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from decode_step import filled_runner, step_at_context
from revision_ab import build_revision_kernel, tree_against_baseline

from autobucket.engine.decode import ops as decode_ops
from autobucket.engine.intercept.elementwise import fused_elementwise
from autobucket.engine.intercept.kernel_sets import invariant_kernels
from autobucket.engine.kernels.library import load_invariant_kernels
from autobucket.engine.kernels.packed_linear import PackedLinears
from autobucket.engine.kernels.packed_matmul import fixed_order_op, fixed_order_panels
from autobucket.models import build_tiny_model

NAMESPACE = "autobucket_linear_baseline"
# (in_features, out_features): bench-qwen2's q/o, k/v, gate/up, down and head; SmolLM2's gate/up and down
SHAPES = [(256, 256), (256, 128), (256, 1024), (1024, 256), (256, 32000), (576, 1536), (1536, 576)]


def op_results(ops: dict, rows_list: list[int], repeats: int) -> list[dict]:
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    results = []
    for in_features, out_features in SHAPES:
        weight = torch.randn(out_features, in_features) / in_features**0.5
        panels, bias = fixed_order_panels(weight), torch.randn(out_features)
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            call = (x, panels, bias, out_features)
            functions = {name: (lambda op=op, call=call: op(*call)) for name, op in ops.items()}
            for cache in ("warm", "cold"):
                before = (lambda: flush.fill_(1)) if cache == "cold" else None
                compared = tree_against_baseline(functions, repeats, before=before)
                medians, gflop = compared["medians_ms"], 2 * rows * in_features * out_features / 1e9
                results.append({"shape": [rows, in_features, out_features], "cache": cache, **compared,
                                "gflops": {n: gflop / (ms / 1e3) for n, ms in medians.items()}})  # fmt: skip
                print(f"{rows} x {in_features} x {out_features} {cache}: tree {medians['tree']:.3f} ms, baseline "
                      f"{medians['baseline']:.3f} ms, ratio {compared['ratio_tree_to_baseline']:.3f}; bitwise equal "
                      f"{compared['bitwise_equal']}")  # fmt: skip
    return results


@torch.inference_mode()
def step_result(ops: dict, rows: int, context: int, repeats: int) -> dict:
    model = build_tiny_model("bench-qwen2")
    runner = filled_runner(model, rows, context, None)
    packs = PackedLinears(fuse=True)

    used: set[str] = set()  # builds whose linears a kernel step took (the direct step would take neither)

    def step(name, op):
        def linear_op():
            used.add(name)
            return op

        def run():
            decode_ops.fixed_order_op = linear_op  # the kernel step's linears on this build
            with invariant_kernels(packs), fused_elementwise(model):
                return step_at_context(runner)

        return run

    try:
        compared = tree_against_baseline({name: step(name, op) for name, op in ops.items()}, repeats)
    finally:
        decode_ops.fixed_order_op = fixed_order_op
    assert used == set(ops), "the kernel decode step did not run: nothing was compared"
    medians = compared["medians_ms"]
    print(f"decode step {rows} x {context}: tree {medians['tree']:.2f} ms, baseline {medians['baseline']:.2f} ms, "
          f"ratio {compared['ratio_tree_to_baseline']:.3f}; bitwise equal {compared['bitwise_equal']}")  # fmt: skip
    return {"rows": rows, "context": context, **compared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare against (default HEAD)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--op-rows", default="8,32,64", help="rows of the op-level shapes, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="results/linear_ab.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_invariant_kernels()
    tree = fixed_order_op()
    if tree is None:
        raise SystemExit("this CPU's kernel library has no vector fixed-order linear: nothing to compare")
    build_revision_kernel(args.baseline, "fixed_order_linear.cpp", NAMESPACE)
    ops = {"tree": tree, "baseline": getattr(torch.ops, NAMESPACE).fixed_order_linear}
    record = {"baseline": args.baseline, "step": step_result(ops, args.rows, args.context, 3 * args.repeats)}
    record["ops"] = op_results(ops, [int(r) for r in args.op_rows.split(",")], args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
