"""Timing shared by the benchmarks: contenders interleaved, so drift on this VM hits them alike (kernel
calls in turn, `interleaved`; whole calls over rounds of fresh inputs in ABBA order, `abba_rounds`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


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
    """Two contenders, one round per seed, in ABBA order (the first named runs first in even rounds, second
    in odd ones), so drift between rounds hits both alike. `round_input(seed)` (untimed) makes the round's
    input; each call takes it and the seed and returns what both must agree on. Prints every round.

    Returns samples_ms (name -> ms), medians_ms, round_ratios (first / second, per round),
    median_round_ratio and outputs_equal (every round's outputs equal)."""
    first, second = calls
    samples: dict[str, list[float]] = {name: [] for name in calls}
    equal = True
    for index, seed in enumerate(seeds):
        data, outputs = round_input(seed), {}
        for name in (first, second) if index % 2 == 0 else (second, first):
            started = time.perf_counter()
            outputs[name] = calls[name](data, seed)
            samples[name].append((time.perf_counter() - started) * 1e3)
        equal = equal and outputs[first] == outputs[second]
        print(f"round {index}: {first} {samples[first][-1]:.0f} ms, {second} {samples[second][-1]:.0f} ms, "
              f"ratio {samples[first][-1] / samples[second][-1]:.3f}")  # fmt: skip
    ratios = [a / b for a, b in zip(samples[first], samples[second], strict=True)]
    return {
        "samples_ms": samples,
        "medians_ms": {name: statistics.median(values) for name, values in samples.items()},
        "round_ratios": ratios,
        "median_round_ratio": statistics.median(ratios),
        "outputs_equal": equal,
    }
