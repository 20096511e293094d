"""Workloads and interleaved timing shared by the benchmarks and the `sweep` CLI.

Contenders run in an interleaved order (A B C, A B C, ...) after one warm-up each, so a slow
phase of a shared machine hits every contender alike; medians and ratios are reported, never
absolute thresholds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Workload:
    name: str
    lengths: tuple[int, ...]


def reference_workloads() -> list[Workload]:
    """The reference PR's five shapes: 32 prompts each."""
    return [
        Workload("short similar (20..13 x4)", tuple(list(range(20, 12, -1)) * 4)),
        Workload("long tail (1x512 + 31x16)", (512,) + (16,) * 31),
        Workload("short tail (1x20 + 31x1)", (20,) + (1,) * 31),
        Workload("moderate tail (1x128 + 31x4)", (128,) + (4,) * 31),
        Workload("spread (16, 32, ..., 512)", tuple(range(16, 513, 16))),
    ]


@dataclass
class ContenderRun:
    """What one contender produced on one workload."""

    samples_ms: list[float] = field(default_factory=list)
    tokens: list[list[int]] | None = None
    profile: dict[str, Any] | None = None  # the last run's profile, when the contender has one

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.samples_ms)


# A contender: prompts -> (generated tokens, profile dict or None)
Contender = Callable[[list[list[int]]], tuple[list[list[int]], dict[str, Any] | None]]


def time_interleaved(
    contenders: dict[str, Contender], prompts: list[list[int]], repeats: int, warmup: int = 1
) -> dict[str, ContenderRun]:
    runs = {name: ContenderRun() for name in contenders}
    for _ in range(warmup):
        for name, contender in contenders.items():
            runs[name].tokens, runs[name].profile = contender(prompts)
    for _ in range(repeats):
        for name, contender in contenders.items():
            started = time.perf_counter()
            tokens, profile = contender(prompts)
            runs[name].samples_ms.append((time.perf_counter() - started) * 1e3)
            runs[name].tokens, runs[name].profile = tokens, profile
    return runs


def tokens_agree(runs: dict[str, ContenderRun], reference: str) -> dict[str, bool]:
    expected = runs[reference].tokens
    return {name: run.tokens == expected for name, run in runs.items()}
