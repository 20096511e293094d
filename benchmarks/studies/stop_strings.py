"""What matching stop strings costs a GRPO-like call: the same call with and without two stop strings that
do not fire, alternating in one process.

    quiet-run -- python benchmarks/studies/stop_strings.py --out results/stop_strings.json
    # smoke: --rounds 2 --prompts 2 --n 2 --new-tokens 4 --out /tmp/stops.json

The call is `shared_decode.py`'s (bench-qwen2, `--kernels`, `--prompts` prompts of ShareGPT-like lengths x
`--n` samples, `--new-tokens` tokens, temperature 1, EOS off), on one thread. The "stops" contender adds
`SamplingConfig(stop_strings=["</tool_call>", "\\n\\nUser:"])`, matched with SmolLM2's tokenizer (its 49,152
ids cover bench-qwen2's 32,000): each decode step then runs one batched `StopStringCriteria` match over
every row's last ids. The strings are chosen not to fire on this random-weight model, so both contenders
generate the same tokens (checked; a round where one fires is reported, since its call is shorter). ABBA
over `--rounds` rounds of fresh prompts after a warm-up; medians, the ratio and raw samples to JSON."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import abba_rounds, write_rounds
from shared_decode import call_sampling, round_prompts

from autobucket import Rollout, RolloutConfig
from autobucket.models import build_tiny_model, load_model

STOP_STRINGS = ["</tool_call>", "\n\nUser:"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", choices=("torch", "invariant"), default="invariant")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/stop_strings.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, tokenizer = load_model("smollm2")  # the tokenizer only; the embedded model is converted on first use
    model = build_tiny_model("bench-qwen2")
    rollout = Rollout(model, tokenizer, RolloutConfig(route="auto", kernels=args.kernels))
    vocab = model.config.vocab_size

    def sampling(name: str, seed: int):
        plain = call_sampling(args, seed)
        return dataclasses.replace(plain, stop_strings=STOP_STRINGS if name == "stops" else [])

    for name in ("stops", "plain"):  # warm-up: packs made, the kernel library and the matcher built
        rollout.generate(round_prompts(vocab, args.prompts, args.seed), sampling(name, args.seed))
    fired = []  # rows a stop string ended (none expected: the strings are chosen not to fire)

    def call(name: str):
        def run(prompts, seed):
            result = rollout.generate(prompts, sampling(name, seed))
            fired.extend(reason for reasons in result.finish_reasons for reason in reasons if reason == "stop")
            return result.tokens

        return run

    seeds = range(args.seed + 1, args.seed + 1 + args.rounds)
    rounds = abba_rounds({name: call(name) for name in ("stops", "plain")},
                         lambda seed: round_prompts(vocab, args.prompts, seed), seeds)  # fmt: skip
    medians = rounds["medians_ms"]
    print(f"stop strings ({args.kernels} kernels): plain {medians['plain']:.0f} ms, stops {medians['stops']:.0f} ms, "
          f"ratio of medians {medians['stops'] / medians['plain']:.3f}, median of the rounds' ratios "
          f"{rounds['median_round_ratio']:.3f}; tokens equal {rounds['outputs_equal']}; rows ended by a stop string "
          f"{len(fired)}")  # fmt: skip
    write_rounds(args.out, args, rounds, stop_strings=STOP_STRINGS, rows_stopped=len(fired))


if __name__ == "__main__":
    main()
