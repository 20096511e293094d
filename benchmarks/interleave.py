"""Timing shared by the kernel benchmarks: contenders interleaved, so drift on this VM hits them alike."""

from __future__ import annotations

import time
from collections.abc import Callable


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
