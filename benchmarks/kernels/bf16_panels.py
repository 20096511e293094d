"""bf16 weights on the fixed-order linear: bf16 panels (widened as read) against fp32 panels of the same
values, interleaved in one process, where a CPU runs bf16 linears on that kernel (no trusted bf16 GEMM).

    quiet-run -- python benchmarks/kernels/bf16_panels.py --out results/bf16_panels.json
    # smoke: --op-rows 16 --repeats 3 --rounds 1 --prompts 2 --n 2 --new-tokens 4 --out /tmp/bf16p.json

Both panel dtypes run the same build of `fixed_order_linear` and give bitwise the same outputs (checked);
only the bytes held and read per call differ (half for bf16).
- ops: the linear alone on bench-qwen2's and SmolLM2's shapes at `--op-rows`, its weight in cache
  (`warm`) or after a 64 MB write (`cold`), medians of `--repeats` interleaved calls;
- call: bench-qwen2 in bf16, `kernels="invariant"`, the GRPO-like call of `shared_decode.py` (`--prompts`
  prompts of ShareGPT-like lengths x `--n` samples, `--new-tokens` tokens, temperature 1, EOS off), one
  Rollout whose packs were made as fp32 panels (what the engine held before bf16 panels) and one with
  bf16 panels, alternating over `--rounds` rounds of fresh prompts after a warm-up round; tokens must
  be equal. Medians, ratios bf16 / fp32 panels, packed bytes and raw samples to JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import abba_rounds, interleaved
from shared_decode import call_sampling, round_prompts

from autobucket import Rollout, RolloutConfig
from autobucket.costs.calibration_file import host_cpu
from autobucket.engine.kernels import packed_matmul
from autobucket.engine.kernels.library import load_invariant_kernels
from autobucket.engine.kernels.packed_matmul import fixed_order_op, fixed_order_panels
from autobucket.models import build_tiny_model

# (in_features, out_features): bench-qwen2's q/o, k/v, gate/up, down and head; SmolLM2's gate/up, down, head
SHAPES = [(256, 256), (256, 128), (256, 1024), (1024, 256), (256, 32000), (576, 1536), (1536, 576), (576, 49152)]


def op_results(rows_list: list[int], repeats: int) -> list[dict]:
    op, flush = fixed_order_op(), torch.empty(64 << 20, dtype=torch.uint8)
    results = []
    for in_features, out_features in SHAPES:
        weight = (torch.randn(out_features, in_features) / in_features**0.5).bfloat16()
        panels = {"bf16": fixed_order_panels(weight), "fp32": fixed_order_panels(weight.float())}
        bias = torch.randn(out_features)
        for rows in rows_list:
            x = torch.randn(rows, in_features).bfloat16().float()  # what a bf16 model's linear receives, widened
            calls = {name: (lambda call=(x, p, bias, out_features): op(*call)) for name, p in panels.items()}
            equal = torch.equal(calls["bf16"](), calls["fp32"]())
            for cache in ("warm", "cold"):
                before = (lambda: flush.fill_(1)) if cache == "cold" else None
                samples = interleaved(calls, repeats, before=before)
                medians = {name: statistics.median(values) for name, values in samples.items()}
                ratio = medians["bf16"] / medians["fp32"]
                results.append({"shape": [rows, in_features, out_features], "cache": cache, "medians_ms": medians,
                                "ratio_bf16_to_fp32": ratio, "bitwise_equal": equal, "samples_ms": samples})  # fmt: skip
                print(f"{rows} x {in_features} x {out_features} {cache}: bf16 panels {medians['bf16']:.3f} ms, "
                      f"fp32 panels {medians['fp32']:.3f} ms, ratio {ratio:.3f}; bitwise equal {equal}")  # fmt: skip
    return results


def rollout_with_panels(model: torch.nn.Module, dtype: torch.dtype, warmup: tuple) -> Rollout:
    """A Rollout whose packs are made (during its warm-up call) as `dtype` panels; kept until the weights
    change, which they do not here."""
    rollout = Rollout(model, config=RolloutConfig(route="auto", kernels="invariant"))
    chosen = packed_matmul.panels_dtype
    packed_matmul.panels_dtype = lambda weight_dtype: dtype if weight_dtype == torch.bfloat16 else torch.float32
    try:
        rollout.generate(*warmup)
    finally:
        packed_matmul.panels_dtype = chosen
    return rollout


def call_results(args: argparse.Namespace) -> dict:
    model = build_tiny_model("bench-qwen2").to(torch.bfloat16)
    vocab = model.config.vocab_size

    warmup = (round_prompts(vocab, args.prompts, args.seed), call_sampling(args, args.seed))
    rollouts = {"fp32": rollout_with_panels(model, torch.float32, warmup),
                "bf16": rollout_with_panels(model, torch.bfloat16, warmup)}  # fmt: skip
    packed = {name: rollout.packed_linears.nbytes for name, rollout in rollouts.items()}

    def call(name: str):
        return lambda prompts, seed: rollouts[name].generate(prompts, call_sampling(args, seed)).tokens

    seeds = range(args.seed + 1, args.seed + 1 + args.rounds)
    rounds = abba_rounds({"bf16": call("bf16"), "fp32": call("fp32")},
                         lambda seed: round_prompts(vocab, args.prompts, seed), seeds)  # fmt: skip
    medians, equal = rounds["medians_ms"], rounds["outputs_equal"]
    ratio = medians["bf16"] / medians["fp32"]
    print(f"call: bf16 panels {medians['bf16']:.0f} ms, fp32 panels {medians['fp32']:.0f} ms, ratio {ratio:.3f}; "
          f"tokens equal {equal}; packed MiB bf16 {packed['bf16'] / 2**20:.1f}, fp32 {packed['fp32'] / 2**20:.1f}")  # fmt: skip
    return {"medians_ms": medians, "ratio_bf16_to_fp32": ratio, "tokens_equal": equal, "packed_bytes": packed,
            "samples_ms": rounds["samples_ms"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op-rows", default="16,64,512", help="rows of the op-level shapes, comma-separated")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bf16_panels.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_invariant_kernels()
    if fixed_order_op() is None:
        raise SystemExit("this CPU's kernel library has no vector fixed-order linear: nothing to compare")
    record = {"cpu": host_cpu(), "torch": torch.__version__, "args": vars(args)}
    record["ops"] = op_results([int(r) for r in args.op_rows.split(",")], args.repeats)
    record["call"] = call_results(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
