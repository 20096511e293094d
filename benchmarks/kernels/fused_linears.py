"""The invariant decode step with and without fused linears (q/k/v and gate/up as one GEMM), interleaved.

    taskset -c 0 python benchmarks/kernels/fused_linears.py --model smollm2 --dtype bfloat16 --rows 4 --out results/fused_linears.json

The static cache holds `rows` prompts of `context` tokens; every timed step decodes at that context.
Both contenders run `kernels="invariant"`'s kernels on their own packed copies (`PackedLinears(fuse=True)`
and `PackedLinears()`), alternating which goes first; medians of `--repeats` after `--warmup` steps
each, and the logits' largest difference (0: fusing never changes a value). Fusion applies to bf16
row-block packs only, so an fp32 run measures two identical contenders (the noise floor)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from decode_step import filled_runner, step_at_context, timed

from autobucket import load_model
from autobucket.engine.intercept.kernel_sets import invariant_kernels
from autobucket.engine.kernels.packed_linear import PackedLinears


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-qwen2")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="results/fused_linears.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, _ = load_model(args.model, dtype=args.dtype)
    runner = filled_runner(model, args.rows, args.context, None)
    contenders = {"fused": PackedLinears(fuse=True), "unfused": PackedLinears()}

    def step(packs: PackedLinears) -> torch.Tensor:
        with invariant_kernels(packs), torch.inference_mode():
            return step_at_context(runner)

    difference = (step(contenders["fused"]) - step(contenders["unfused"])).abs().max().item()
    for packs in contenders.values():
        for _ in range(args.warmup):
            step(packs)
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(args.repeats):
        order = list(contenders) if repeat % 2 else list(contenders)[::-1]
        for name in order:
            samples[name].append(timed(lambda packs=contenders[name]: step(packs)))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    fusion = contenders["fused"].fusion
    groups = len(fusion.groups) if fusion else 0
    print(f"{args.model} {args.dtype} rows {args.rows} context {args.context}: fused {medians['fused']:.2f} ms, "
          f"unfused {medians['unfused']:.2f} ms (fused / unfused {medians['fused'] / medians['unfused']:.3f}; "
          f"{groups} fused groups; max |logit difference| {difference:.1e})")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**vars(args), "fused_groups": groups, "max_logit_difference": difference,
                                          "medians_ms": medians, "samples_ms": samples}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
