"""A sliding-window model's call that outgrows its window: ordinary `generate` (what route="auto" ran for
such a call until the continuous-batching routes applied windows) against auto on those routes.

    quiet-run -- python benchmarks/sliding_window.py --out results/sliding_window.json
    # smoke: --prompts 4 --new-tokens 8 --rounds 2 --out /tmp/sliding_window.json

The model is bench-qwen2's geometry (hidden 256, 4 layers, 32,000 ids, random weights) as a Mistral with
a `--window`-token sliding window on every layer (Mistral 7B v0.1's design; Gemma 3 windows five layers
of six). Each round: `--prompts` fresh ShareGPT-like prompts, greedy, EOS off, `--new-tokens` each, so
the longer sequences outgrow the window. One warm-up call each, then rounds in ABBA order; the tokens
must agree (both equal HF generate, by the tests). One thread (pin the process with taskset/quiet-run)."""

from __future__ import annotations

import argparse

import torch
import transformers
from interleave import abba_rounds, write_rounds

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.prompts import random_prompts
from autobucket.tools.workloads import sharegpt_like_lengths


def windowed_bench_model(window: int) -> torch.nn.Module:
    config = transformers.MistralConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=32000, initializer_range=0.2, max_position_embeddings=4096, sliding_window=window,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="results/sliding_window.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = windowed_bench_model(args.window)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, eos_token_id=[])
    rollouts = {"ordinary generate": Rollout(model, config=RolloutConfig(route="ordinary")),
                "auto (continuous batching)": Rollout(model, config=RolloutConfig(route="auto"))}  # fmt: skip
    routes: list[str] = []

    def call(name: str):
        def run(prompts, seed):
            result = rollouts[name].generate(prompts, sampling)
            routes.append(f"{name}: {result.route}")
            return result.tokens
        return run

    def round_input(seed: int):
        return random_prompts(sharegpt_like_lengths(args.prompts, seed=seed), 32000, seed=seed)

    warm = round_input(10_000)
    for name in rollouts:  # warm-up (auto's online probe runs here)
        call(name)(warm, 0)
    outgrowing = sum(len(p) + args.new_tokens > args.window for p in round_input(0))
    print(f"window {args.window}: {outgrowing} of {args.prompts} sequences of round 0 outgrow it")
    rounds = abba_rounds({name: call(name) for name in rollouts}, round_input, range(args.rounds))
    print("| contender | median ms | / ordinary |")
    ordinary = rounds["medians_ms"]["ordinary generate"]
    for name, median in rounds["medians_ms"].items():
        print(f"| {name} | {median:,.0f} | {median / ordinary:.2f} |")
    print(f"tokens equal every round: {rounds['outputs_equal']}; routes run: {sorted(set(routes))}")
    write_rounds(args.out, args, rounds, routes=sorted(set(routes)))


if __name__ == "__main__":
    main()
