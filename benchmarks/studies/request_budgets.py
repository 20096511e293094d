"""What per-request budgets save an agent turn whose conversations have different budgets left: one call with
`max_new_tokens=[...]` against the two ways without it, in one process, the order rotated each round.

    quiet-run -- python benchmarks/studies/request_budgets.py --out results/request_budgets.json
    # smoke: --rounds 3 --prompts 4 --least 2 --most 8 --out /tmp/budgets.json

The turn: `--prompts` conversations of ShareGPT-like lengths on bench-qwen2 (`--kernels`, one thread), each
with its own budget left, drawn uniformly from [`--least`, `--most`] (what a rollout budget of 256 tokens
leaves after earlier turns), temperature 1, per-prompt seeds, EOS off, every row decoded at once (or
`--continuous-batch-size` rows, the rest queued).
Contenders:
- "per_request": one call, `SamplingConfig(max_new_tokens=budgets)`: a row retires at its budget;
- "shifting_rows": per_request with retired rows compacted in input order (every row after a retired one
  shifted, as before `static_cache.fill_holes_order`; only with --shifting-rows);
- "largest_cut": one call with the largest budget for all, each completion cut to its own afterwards (every
  row decodes until the longest is done);
- "input_order": per_request with the requests admitted in input order (the engine admits the largest
  budget first; this measures what that ordering saves when rows refill);
- "per_budget": one call per distinct budget (what autobucket's TRL adapter did before: with budgets drawn
  from a range nearly every conversation is its own call).
With the invariant kernels a request's tokens do not depend on its batch, so all three return the same
tokens (checked every round). Medians, ratios to per_request and raw samples go to JSON."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import abba_rounds, write_rounds
from shared_decode import round_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.batching import batcher
from autobucket.models import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", choices=("torch", "invariant"), default="invariant")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--least", type=int, default=16)
    parser.add_argument("--most", type=int, default=128)
    parser.add_argument("--continuous-batch-size", type=int, default=None, help="rows decoded at once "
                        "(default: every prompt's; fewer makes the rest queue and refill retired rows)")  # fmt: skip
    parser.add_argument("--shifting-rows", action="store_true", help="add the shifting_rows contender")
    parser.add_argument("--skip-per-budget", action="store_true", help="leave out the slowest contender")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/request_budgets.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_tiny_model("bench-qwen2")
    rollout = Rollout(model, config=RolloutConfig(route="auto", kernels=args.kernels))
    vocab = model.config.vocab_size
    rows = args.continuous_batch_size or args.prompts

    def turn(seed: int):
        rng = random.Random(seed)
        budgets = [rng.randint(args.least, args.most) for _ in range(args.prompts)]
        return round_prompts(vocab, args.prompts, seed), budgets

    def sampling(budget, seeds) -> SamplingConfig:
        return SamplingConfig(max_new_tokens=budget, seed=seeds, temperature=1.0, eos_token_id=[],
                              continuous_batch_size=rows)  # fmt: skip

    def per_request(data, seed):
        prompts, budgets = data
        return rollout.generate(prompts, sampling(budgets, stream_keys(seed, len(prompts)))).tokens

    def input_order(data, seed):
        with admitted_in_input_order():
            return per_request(data, seed)

    def shifting_rows(data, seed):
        with rows_shifted_on_retirement():
            return per_request(data, seed)

    def largest_cut(data, seed):
        prompts, budgets = data
        tokens = rollout.generate(prompts, sampling(max(budgets), stream_keys(seed, len(prompts)))).tokens
        return [t[:budget] for t, budget in zip(tokens, budgets, strict=True)]

    def per_budget(data, seed):
        prompts, budgets = data
        keys, tokens = stream_keys(seed, len(prompts)), [None] * len(prompts)
        for budget in sorted(set(budgets)):
            members = [i for i, b in enumerate(budgets) if b == budget]
            result = rollout.generate([prompts[i] for i in members], sampling(budget, [keys[i] for i in members]))
            for i, t in zip(members, result.tokens, strict=True):
                tokens[i] = t
        return tokens

    calls = {"per_request": per_request, "input_order": input_order, "largest_cut": largest_cut}
    if args.shifting_rows:
        calls["shifting_rows"] = shifting_rows
    if not args.skip_per_budget:
        calls["per_budget"] = per_budget
    warm = turn(args.seed)
    for call in calls.values():  # warm-up: packs made, the kernel library built
        call(warm, args.seed)
    seeds = range(args.seed + 1, args.seed + 1 + args.rounds)
    rounds = abba_rounds(calls, turn, seeds)
    medians = rounds["medians_ms"]
    summary = ", ".join(
        f"{name} {medians[name]:.0f} ms (per_request / it: median of rounds {statistics.median(ratios):.3f})"
        for name, ratios in rounds["ratios_to_first"].items()
    )
    print(f"per-request budgets ({args.kernels} kernels, {args.prompts} prompts, {rows} rows at once, budgets "
          f"{args.least}-{args.most}): "
          f"per_request {medians['per_request']:.0f} ms, {summary}; tokens equal {rounds['outputs_equal']}")  # fmt: skip
    write_rounds(args.out, args, rounds, ratios_to_per_request=rounds["ratios_to_first"])


@contextmanager
def admitted_in_input_order():
    """The batcher's queue in input order for the calls inside (it admits the largest budget first)."""
    saved = batcher.admission_order
    batcher.admission_order = lambda budgets: list(range(len(budgets)))
    try:
        yield
    finally:
        batcher.admission_order = saved


@contextmanager
def rows_shifted_on_retirement():
    """Retired rows compacted in input order for the calls inside (the engine fills the holes from the end)."""
    saved = batcher.fill_holes_order
    batcher.fill_holes_order = list
    try:
        yield
    finally:
        batcher.fill_holes_order = saved


def stream_keys(seed: int, count: int) -> list[int]:
    """Per-prompt seeds: a prompt's samples then do not depend on which call or position it runs in."""
    return [seed * 1000 + i for i in range(count)]


if __name__ == "__main__":
    main()
