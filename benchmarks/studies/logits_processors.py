"""What per-sequence logits processors cost a GRPO-like call: the same call plain, with a caller's processor
that changes nothing, with `suppress_tokens` and with `no_repeat_ngram_size`, rotated in one process.

    quiet-run -- python benchmarks/studies/logits_processors.py --out results/logits_processors.json
    # smoke: --rounds 2 --prompts 2 --n 2 --new-tokens 4 --out /tmp/processors.json

The call is `shared_decode.py`'s (bench-qwen2, `--kernels`, `--prompts` prompts of ShareGPT-like lengths x
`--n` samples, `--new-tokens` tokens, temperature 1, EOS off), on one thread. Every processor is called
once per sequence and decode step with that sequence's ids `[1, prompt + generated]`
(`engine/sampling/row_processors.py`), so "identity" is the dispatch alone (its tokens must equal the
plain call's; checked), `suppress_tokens` (16 ids) HF's mask on top, and `no_repeat_ngram_size=3` HF's
n-gram scan of the whole sequence each step (these two change tokens: their calls still decode the same
number of steps). Rounds of fresh prompts, the order rotated; medians, ratios to plain and raw samples to JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import abba_rounds, write_rounds
from shared_decode import call_sampling, round_prompts

from autobucket import Rollout, RolloutConfig
from autobucket.models import build_tiny_model


def identity(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    return scores


CONTENDERS = {
    "plain": {},
    "identity": {"logits_processor": [identity]},
    "suppress_tokens": {"suppress_tokens": list(range(100, 116))},
    "no_repeat_ngram_size": {"no_repeat_ngram_size": 3},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", choices=("torch", "invariant"), default="invariant")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/logits_processors.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_tiny_model("bench-qwen2")
    rollout = Rollout(model, config=RolloutConfig(route="auto", kernels=args.kernels))
    vocab = model.config.vocab_size
    for options in CONTENDERS.values():  # warm-up: packs made, the kernel library built
        rollout.generate(round_prompts(vocab, args.prompts, args.seed), call_sampling(args, args.seed), **options)
    tokens_by_round: dict[str, dict[int, list]] = {name: {} for name in CONTENDERS}

    def call(name: str):
        def run(prompts, seed):
            tokens = rollout.generate(prompts, call_sampling(args, seed), **CONTENDERS[name]).tokens
            tokens_by_round[name][seed] = tokens  # compared after the rounds, untimed
            return len(tokens)  # the processors that mask change tokens: rounds agree on the count only

        return run

    seeds = range(args.seed + 1, args.seed + 1 + args.rounds)
    rounds = abba_rounds({name: call(name) for name in CONTENDERS},
                         lambda seed: round_prompts(vocab, args.prompts, seed), seeds)  # fmt: skip
    identical = [tokens_by_round["identity"][seed] == tokens_by_round["plain"][seed] for seed in seeds]
    medians = rounds["medians_ms"]
    ratios = ", ".join(f"{name} {medians[name]:.0f} ms ({medians[name] / medians['plain']:.3f})" for name in CONTENDERS)
    steps = args.new_tokens * args.prompts * args.n
    extra_us = {name: (medians[name] - medians["plain"]) * 1e3 / steps for name in CONTENDERS}
    print(f"logits processors ({args.kernels} kernels), median and ratio to plain: {ratios}; per sequence and step "
          f"beyond plain: " + ", ".join(f"{name} {us:.0f} us" for name, us in extra_us.items() if name != "plain")
          + f"; identity's tokens equal plain's every round: {all(identical)}")  # fmt: skip
    write_rounds(args.out, args, rounds, per_sequence_step_us=extra_us, identity_equal=all(identical))
    if not all(identical):
        raise SystemExit("a processor that returns its scores changed a token")


if __name__ == "__main__":
    main()
