"""Cascade decode's shared prompt keys transposed into the invariant kernel's tiles once per call
(`CascadeLayout.shared_tiles`) against anew in every step and layer, on the GRPO-like call.

    quiet-run -- python benchmarks/cascade_tiles.py --out results/cascade_tiles.json

The call of shared_decode.py (`--prompts` ShareGPT-like prompts x `--n` samples, 64 new tokens, T = 1, EOS
off) on bench-qwen2 (`--dtype`) with `kernels="invariant"`, the two contenders in ABBA rounds of fresh
prompts in one process (the per-step form: `CascadeLayout.shared_tiles` replaced by one returning None).
Each round's tokens and logprobs must be bitwise equal between the two, else the script fails. Where the
build reads no tiles (AVX2 fp32 walks the prefix in place; builds without a vector form) both contenders
run the same code. Medians, per-round ratios and raw samples to JSON."""

from __future__ import annotations

import argparse
import dataclasses

import torch
from interleave import abba_rounds, write_rounds

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.kernels.cascade_attention import CascadeLayout
from autobucket.models import build_tiny_model
from autobucket.prompts import random_prompts
from autobucket.tools.workloads import sharegpt_like_lengths


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
    rollout = Rollout(model, config=RolloutConfig(route="auto", kernels="invariant"))
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, eos_token_id=[], n=args.n, temperature=1.0,
                              logprobs=True, continuous_batch_size=args.prompts * args.n)  # fmt: skip
    kept = CascadeLayout.shared_tiles

    def call(keep: bool):
        def run(prompts, seed):
            CascadeLayout.shared_tiles = kept if keep else (lambda self, layer: None)
            try:
                result = rollout.generate(prompts, dataclasses.replace(sampling, seed=seed))
            finally:
                CascadeLayout.shared_tiles = kept
            return result.tokens, result.logprobs  # nested lists of ints and floats: compared with ==
        return run

    def round_input(seed: int):
        return random_prompts(sharegpt_like_lengths(args.prompts, seed=seed), model.config.vocab_size, seed=seed)

    calls = {"tiles kept": call(True), "tiles per step": call(False)}
    for function in calls.values():  # warm-up: packs, probes, kernel library
        function(round_input(1000), 1000)
    rounds = abba_rounds(calls, round_input, range(args.rounds))
    medians = rounds["medians_ms"]
    print(f"GRPO-like {args.dtype} call ({args.prompts} x n = {args.n}, {args.new_tokens} new tokens): tiles kept "
          f"{medians['tiles kept']:.0f} ms, per step {medians['tiles per step']:.0f} ms, ratio "
          f"{rounds['median_round_ratio']:.3f} (rounds {min(rounds['round_ratios']):.3f}-{max(rounds['round_ratios']):.3f}); "
          f"tokens and logprobs bitwise equal: {rounds['outputs_equal']}")  # fmt: skip
    write_rounds(args.out, args, rounds)
    if not rounds["outputs_equal"]:
        raise SystemExit("kept tiles changed a token or a logprob")


if __name__ == "__main__":
    main()
