"""A sliding-window model's call that outgrows its window: ordinary `generate` (what route="auto" ran for
such a call until the continuous-batching routes applied windows) against auto on those routes.

    quiet-run -- python benchmarks/studies/sliding_window.py --out results/sliding_window.json
    # smoke: --prompts 4 --new-tokens 8 --rounds 2 --out /tmp/sliding_window.json
    quiet-run -- python benchmarks/studies/sliding_window.py --n 8 --prompts 8 --kernels invariant --out results/sliding_window_n8.json

The model is bench-qwen2's geometry (hidden 256, 4 layers, 32,000 ids, random weights) as a Mistral with
a `--window`-token sliding window on every layer (Mistral 7B v0.1's design; Gemma 3 windows five layers
of six). Each round: `--prompts` fresh ShareGPT-like prompts, greedy, EOS off, `--new-tokens` each, so
the longer sequences outgrow the window. One warm-up call each, then rounds in ABBA order; the tokens
must agree (both equal HF generate, by the tests). One thread (pin the process with taskset/quiet-run).

`--n` > 1 (a GRPO-like call past the window: n samples a prompt at temperature 1, the round's seed):
the contenders are auto with a prompt's samples reading one shared copy of its K/V (cascade decode,
each sliding layer's row reading the shared keys its window covers) and the same Rollout settings
with per-row copies (`routes.SHARED_PREFIX_MIN_SAVED_COLUMNS`, which the engine reads at every call, set past
any call around that contender's calls). Both sample the same tokens (bitwise under either kernel
set, by tests/engine/test_model_limits.py). `--model-forward-contender` adds auto with every decode step through
the model's own forward instead of the direct (and, under `kernels="invariant"`, kernel) step."""

from __future__ import annotations

import argparse
import contextlib
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
import transformers
from interleave import abba_rounds, write_rounds
from shared_decode import per_row_copies

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.decode.parts import LlamaParts
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


@contextmanager
def model_forward_steps():
    """Every decode step through the model's own forward (no direct or kernel step) for the calls inside."""
    saved = LlamaParts.of
    LlamaParts.of = classmethod(lambda cls, model: None)
    try:
        yield
    finally:
        LlamaParts.of = saved


def contenders(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, tuple[Rollout, list]]:
    """name -> (its Rollout, the context managers its calls run in)."""
    config = RolloutConfig(route="auto", kernels=args.kernels)
    if args.n == 1:
        named = {"ordinary generate": (Rollout(model, config=RolloutConfig(route="ordinary", kernels=args.kernels)), []),
                 "auto (continuous batching)": (Rollout(model, config=config), [])}  # fmt: skip
    else:
        named = {"auto, per-row copies": (Rollout(model, config=config), [per_row_copies]),
                 "auto, shared prompt K/V": (Rollout(model, config=config), [])}  # fmt: skip
    if args.model_forward_contender:
        named["auto, the model's forward each step"] = (Rollout(model, config=config), [model_forward_steps])
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--n", type=int, default=1, help="samples a prompt (> 1: shared K/V against copies)")
    parser.add_argument("--kernels", choices=("torch", "invariant"), default="torch")
    parser.add_argument("--model-forward-contender", action="store_true",
                        help="add auto with every decode step through the model's own forward (no direct step)")  # fmt: skip
    parser.add_argument("--out", default="results/sliding_window.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = windowed_bench_model(args.window)
    rollouts = contenders(model, args)
    runs: list[str] = []

    def call(name: str):
        def run(prompts, seed):
            rollout, scopes = rollouts[name]
            sampling = SamplingConfig(max_new_tokens=args.new_tokens, eos_token_id=[], n=args.n,
                                      temperature=1.0 if args.n > 1 else 0.0, seed=seed)  # fmt: skip
            with contextlib.ExitStack() as stack:
                for scope in scopes:
                    stack.enter_context(scope())
                result = rollout.generate(prompts, sampling)
            runs.append(f"{name}: {result.route}, shared_kv_rows {result.profile.shared_kv_rows}, "
                        f"decode_forward {result.profile.decode_forward}")  # fmt: skip
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
    first = next(iter(rollouts))
    print(f"| contender | median ms | / {first} |")
    for name, median in rounds["medians_ms"].items():
        print(f"| {name} | {median:,.0f} | {median / rounds['medians_ms'][first]:.2f} |")
    print(f"tokens equal every round: {rounds['outputs_equal']}; runs: {sorted(set(runs))}")
    write_rounds(args.out, args, rounds, routes=sorted(set(runs)))


if __name__ == "__main__":
    main()
