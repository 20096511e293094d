"""bf16 linears at a decode step's 33-128 rows: one padded oneDNN call (`packed_matmul.decode_block_for`)
against 32-row blocks, each of which streams the whole weight.

    quiet-run -- python benchmarks/kernels/bf16_decode_blocks.py --out results/bf16_decode_blocks.json

Two parts, one process, one thread:
1. Per shape (bench-qwen2's projections and head, SmolLM2's): oneDNN's bf16 GEMM on a packed weight at
   48, 64, 96 and 128 rows, as one padded call of the decode block against 32-row blocks (the library's
   `blocked_linear`), calls interleaved, weights cycled through ~200 MB of copies so they come from DRAM
   as in a step; and whether the shape's probe passes (a size it refuses is never used).
2. Whole calls: the GRPO-like call of shared_decode.py (`--prompts` ShareGPT-like prompts x `--n`
   samples, 64 new tokens, T = 1, EOS off) on bench-qwen2 in bf16 with `kernels="invariant"`, decode
   blocks on and off (`decode_block_for` replaced by one returning None), ABBA rounds of fresh prompts;
   each round's tokens and logprobs must be bitwise equal between the two (every row gets its 32-row
   result either way), else the script fails.

Needs a CPU with a native bf16 GEMM (AVX512-BF16 / AMX); elsewhere bf16 weights run as fp32 panels and
there is nothing to compare (it says so and exits 0). Medians, per-round ratios and raw samples to JSON."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import grpo_switch_rounds

import autobucket.engine.kernels.packed_matmul as packed_matmul
from autobucket.engine.kernels.onednn_probes import DECODE_BLOCKS, bf16_large_block_agrees, native_bf16_gemm
from autobucket.models import build_tiny_model

# (K, N, bias): bench-qwen2's fused q/k/v, o, fused gate/up, down and head; SmolLM2's q/k/v, MLP and head
SHAPES = [(256, 512, True), (256, 256, False), (256, 2048, False), (1024, 256, False), (256, 32000, False),
          (576, 960, False), (576, 3072, False), (1536, 576, False), (576, 49152, False)]  # fmt: skip
ROWS = (48, 64, 96, 128)
DRAM_BYTES = 200_000_000  # weights cycled through this many bytes of copies: each call reads its own from DRAM


def shape_table(repeats: int) -> list[dict]:
    blocked_linear = packed_matmul._blocked_linear_op()  # the library's op (built on first use)
    records = []
    for k, n, has_bias in SHAPES:
        weight = (torch.randn(n, k) * k**-0.5).bfloat16()
        copies = [torch.ops.mkldnn._reorder_linear_weight(weight, 32) for _ in range(max(2, DRAM_BYTES // (2 * n * k)))]
        bias = torch.randn(n).bfloat16() if has_bias else None
        for rows in ROWS:
            block = next((size for size in DECODE_BLOCKS if size >= rows), DECODE_BLOCKS[-1])
            x = torch.randn(rows, k).bfloat16()
            times: dict[str, list[float]] = {"32-row blocks": [], f"one {block}-row call": []}
            for index in range(repeats + 2):
                for name, size in zip(times, (32, block), strict=True):
                    started = time.perf_counter()
                    blocked_linear(x, copies[index % len(copies)], bias, size)
                    if index >= 2:  # two warm-up rounds
                        times[name].append((time.perf_counter() - started) * 1e3)
            blocks_ms, one_ms = (statistics.median(values) for values in times.values())
            agrees = bf16_large_block_agrees(k, n, block, has_bias)
            records.append({"k": k, "n": n, "rows": rows, "block": block, "blocks_ms": blocks_ms, "one_call_ms": one_ms,
                            "probe_passes": agrees, "samples_ms": times})  # fmt: skip
            print(f"{rows:4d} x {k} x {n}: 32-row blocks {blocks_ms:.3f} ms, one {block}-row call {one_ms:.3f} ms "
                  f"({one_ms / blocks_ms:.2f}x), probe {'passes' if agrees else 'refuses'}")  # fmt: skip
        del copies
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--shape-repeats", type=int, default=30)
    parser.add_argument("--out", default="results/bf16_decode_blocks.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not native_bf16_gemm():
        print("no native bf16 GEMM on this CPU: bf16 weights run as fp32 panels, decode blocks never run")
        return
    print("per shape, weights from DRAM, medians of", args.shape_repeats)
    shapes = shape_table(args.shape_repeats)

    model = build_tiny_model("bench-qwen2").to(torch.bfloat16)
    probed = packed_matmul.decode_block_for

    @contextmanager
    def decode_blocks(on: bool):
        packed_matmul.decode_block_for = probed if on else (lambda *shape: None)
        try:
            yield
        finally:
            packed_matmul.decode_block_for = probed

    grpo_switch_rounds(model, args, ("decode blocks", "32-row blocks"), decode_blocks, shapes=shapes)

if __name__ == "__main__":
    main()
