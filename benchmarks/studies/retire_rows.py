"""What retiring EOS-ended rows costs on real weights: the engine's hole filling (a survivor from the end
takes a retired row's place) against shifting every row after it (as before), in one process.

    quiet-run -- python benchmarks/studies/retire_rows.py --out results/retire_rows.json
    # smoke: --rounds 2 --new-tokens 8 --out /tmp/retire.json

SmolLM2-135M (`--kernels`, one thread), the demo's chat prompts (12 questions and 4 HumanEval tasks, as
`autobucket demo` runs them) repeated `--copies` times, greedy, EOS on, `--new-tokens` at most, every row
decoded at once: rows end at EOS a few at a time, each retirement compacting the cache. Both contenders
return the same tokens (checked); the order alternates each round (ABBA). Medians, the ratio and raw
samples to JSON, with the finish reasons of the call."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import abba_rounds, write_rounds
from request_budgets import rows_shifted_on_retirement

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.models import load_model
from autobucket.tools.demo import demo_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", choices=("torch", "invariant"), default="invariant")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--copies", type=int, default=2, help="each demo prompt this many times (as prompts)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", default="results/retire_rows.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2")
    prompts = [prompt.ids for prompt in demo_prompts(tokenizer)] * args.copies
    rollout = Rollout(model, tokenizer, RolloutConfig(route="auto", kernels=args.kernels))
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, continuous_batch_size=len(prompts))
    reasons: Counter = Counter()

    def fill_holes(data, seed):
        result = rollout.generate(data, sampling)
        reasons.clear()  # the last call's (every call returns the same tokens)
        reasons.update(result.finish_reasons)
        return result.tokens

    def shifting(data, seed):
        with rows_shifted_on_retirement():
            return rollout.generate(data, sampling).tokens

    fill_holes(prompts, 0)  # warm-up: packs made, the kernel library built
    rounds = abba_rounds({"fill_holes": fill_holes, "shifting": shifting}, lambda seed: prompts, range(args.rounds))
    medians = rounds["medians_ms"]
    print(f"retiring rows ({args.kernels} kernels, {len(prompts)} prompts, <= {args.new_tokens} tokens): fill_holes "
          f"{medians['fill_holes']:.0f} ms, shifting {medians['shifting']:.0f} ms, median of the rounds' ratios "
          f"{rounds['median_round_ratio']:.3f}; tokens equal {rounds['outputs_equal']}; finish reasons "
          f"{dict(reasons)}")  # fmt: skip
    write_rounds(args.out, args, rounds, finish_reasons=dict(reasons))


if __name__ == "__main__":
    main()
