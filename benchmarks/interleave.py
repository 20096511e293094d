"""Timing shared by the benchmarks: contenders interleaved, so drift on this VM hits them alike (kernel
calls in turn, `interleaved`; whole calls over rounds of fresh inputs in ABBA order, `abba_rounds`)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from autobucket.costs.calibration_file import host_cpu


def interleaved(
    functions: dict[str, Callable[[], object]], repeats: int, before: Callable[[], object] | None = None
) -> dict[str, list[float]]:
    """One warm-up call each, then `repeats` rounds calling every contender in turn: name -> ms samples.
    `before` runs untimed before every timed call (a cache flush)."""
    for function in functions.values():
        function()
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            if before is not None:
                before()
            started = time.perf_counter()
            function()
            samples[name].append((time.perf_counter() - started) * 1e3)
    return samples


def abba_rounds(
    calls: dict[str, Callable[[Any, int], object]], round_input: Callable[[int], Any], seeds: Sequence[int]
) -> dict[str, Any]:
    """Two or more contenders, one round per seed, the order rotated each round (for two: ABBA, the first
    named runs first in even rounds, second in odd ones), so drift between rounds hits all alike.
    `round_input(seed)` (untimed) makes the round's input; each call takes it and the seed and returns what
    all must agree on. Prints every round.

    Returns samples_ms (name -> ms), medians_ms, round_ratios (first / second, per round),
    median_round_ratio, ratios_to_first (name -> per-round first / name, every other contender) and
    outputs_equal (every round's outputs equal)."""
    names = list(calls)
    first, second = names[:2]
    samples: dict[str, list[float]] = {name: [] for name in calls}
    equal = True
    for index, seed in enumerate(seeds):
        data, outputs = round_input(seed), {}
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            outputs[name] = calls[name](data, seed)
            samples[name].append((time.perf_counter() - started) * 1e3)
        equal = equal and all(outputs[name] == outputs[first] for name in names)
        times = ", ".join(f"{name} {samples[name][-1]:.0f} ms" for name in names)
        print(f"round {index}: {times}, ratio {samples[first][-1] / samples[second][-1]:.3f}")
    ratios = {name: [a / b for a, b in zip(samples[first], samples[name], strict=True)] for name in names[1:]}
    return {
        "samples_ms": samples,
        "medians_ms": {name: statistics.median(values) for name, values in samples.items()},
        "round_ratios": ratios[second],
        "median_round_ratio": statistics.median(ratios[second]),
        "ratios_to_first": ratios,
        "outputs_equal": equal,
    }


def write_rounds(out: str, args: Any, rounds: dict[str, Any], **extra: Any) -> None:
    """`abba_rounds`' result as JSON at `out`: the CPU, torch, the arguments, medians, per-round ratios, whether
    the outputs agreed and the raw samples, with `extra` fields."""
    record = {"cpu": host_cpu(), "torch": torch.__version__, "args": vars(args), "medians_ms": rounds["medians_ms"],
              "round_ratios": rounds["round_ratios"], "tokens_equal": rounds["outputs_equal"], **extra,
              "samples_ms": rounds["samples_ms"]}  # fmt: skip
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=1))


def grpo_switch_rounds(model: Any, args: Any, names: tuple[str, str], switch: Callable[[bool], Any], **extra: Any) -> None:
    """A switch of the engine on and off on the GRPO-like call (`args.prompts` ShareGPT-like prompts x
    `args.n` samples, `args.new_tokens` new tokens, T = 1, EOS off, logprobs; `kernels="invariant"`), ABBA
    rounds of fresh prompts in one process (`args.rounds`). `switch(on)` is a context manager that holds
    the switch on or off around one call; `names` label on and off. Prints the medians and round ratios,
    writes them to `args.out` (with `extra`), and fails where a round's tokens or logprobs differ bitwise."""
    from autobucket import Rollout, RolloutConfig, SamplingConfig
    from autobucket.prompts import random_prompts
    from autobucket.tools.workloads import sharegpt_like_lengths

    rollout = Rollout(model, config=RolloutConfig(route="auto", kernels="invariant"))
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, eos_token_id=[], n=args.n, temperature=1.0,
                              logprobs=True, continuous_batch_size=args.prompts * args.n)  # fmt: skip

    def call(on: bool) -> Callable[[Any, int], object]:
        def run(prompts: Any, seed: int) -> object:
            with switch(on):
                result = rollout.generate(prompts, dataclasses.replace(sampling, seed=seed))
            return result.tokens, result.logprobs  # nested lists of ints and floats: compared with ==
        return run

    def round_input(seed: int) -> list[list[int]]:
        return random_prompts(sharegpt_like_lengths(args.prompts, seed=seed), model.config.vocab_size, seed=seed)

    calls = {names[0]: call(True), names[1]: call(False)}
    for function in calls.values():  # warm-up: packs, probes, kernel library
        function(round_input(1000), 1000)
    rounds = abba_rounds(calls, round_input, range(args.rounds))
    medians = rounds["medians_ms"]
    print(f"GRPO-like {model.dtype} call ({args.prompts} x n = {args.n}, {args.new_tokens} new tokens): {names[0]} "
          f"{medians[names[0]]:.0f} ms, {names[1]} {medians[names[1]]:.0f} ms, ratio {rounds['median_round_ratio']:.3f} "
          f"(rounds {min(rounds['round_ratios']):.3f}-{max(rounds['round_ratios']):.3f}); "
          f"tokens and logprobs bitwise equal: {rounds['outputs_equal']}")  # fmt: skip
    write_rounds(args.out, args, rounds, **extra)
    if not rounds["outputs_equal"]:
        raise SystemExit(f"{names[0]} changed a token or a logprob against {names[1]}")
