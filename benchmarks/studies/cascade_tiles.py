"""Cascade decode's shared prompt keys transposed into the invariant kernel's tiles once per call
(`SharedPrefixLayout.shared_tiles`) against anew in every step and layer, on the GRPO-like call.

    quiet-run -- python benchmarks/studies/cascade_tiles.py --out results/cascade_tiles.json

The call of shared_decode.py (`--prompts` ShareGPT-like prompts x `--n` samples, 64 new tokens, T = 1, EOS
off) on bench-qwen2 (`--dtype`) with `kernels="invariant"`, the two contenders in ABBA rounds of fresh
prompts in one process (the per-step form: `SharedPrefixLayout.shared_tiles` replaced by one returning None).
Each round's tokens and logprobs must be bitwise equal between the two, else the script fails. Where the
build reads no tiles (AVX2 fp32 walks the prefix in place; builds without a vector form) both contenders
run the same code. Medians, per-round ratios and raw samples to JSON."""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import grpo_switch_rounds

from autobucket.engine.kernels.shared_prefix_attention import SharedPrefixLayout
from autobucket.models import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", default="results/cascade_tiles.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_tiny_model("bench-qwen2").to(getattr(torch, args.dtype))
    kept = SharedPrefixLayout.shared_tiles

    @contextmanager
    def tiles_kept(on: bool):
        SharedPrefixLayout.shared_tiles = kept if on else (lambda self, layer: None)
        try:
            yield
        finally:
            SharedPrefixLayout.shared_tiles = kept

    grpo_switch_rounds(model, args, ("tiles kept", "tiles per step"), tiles_kept)

if __name__ == "__main__":
    main()
