"""Workloads and interleaved timing shared by the benchmarks and the `sweep` CLI.

Contenders run in an interleaved order (A B C, A B C, ...) after one warm-up each, so a slow
phase of a shared machine hits every contender alike; medians and ratios are reported, never
absolute thresholds."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autobucket.checks import require_int
from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.profile import reset_peak_memory


@dataclass(frozen=True)
class Workload:
    """Prompt lengths in tokens; every prompt needs one token at least, checked here so that a bad
    workload (e.g. lengths from an empty tokenizer) is refused when it is chosen, not minutes later."""

    name: str
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        for index, length in enumerate(self.lengths):
            try:
                require_int(f"prompt {index}'s length", length, fix="every prompt needs at least one token")
            except ValueError as exc:
                raise ValueError(f"workload {self.name!r}: {exc}") from None


def reference_workloads() -> list[Workload]:
    """The five shapes of the DeepSpeed prefill-bucketing pull request: 32 prompts each."""
    return [
        Workload("short similar (20..13 x4)", tuple(list(range(20, 12, -1)) * 4)),
        Workload("long tail (1x512 + 31x16)", (512,) + (16,) * 31),
        Workload("short tail (1x20 + 31x1)", (20,) + (1,) * 31),
        Workload("moderate tail (1x128 + 31x4)", (128,) + (4,) * 31),
        Workload("spread (16, 32, ..., 512)", tuple(range(16, 513, 16))),
    ]


# ShareGPT-like prompt lengths: lognormal, median 250 tokens, sigma 1.0, clipped to [32, 1024]
SHAREGPT_MEDIAN, SHAREGPT_SIGMA, SHAREGPT_RANGE = 250, 1.0, (32, 1024)


def sharegpt_like_lengths(count: int, seed: int) -> tuple[int, ...]:
    """`count` prompt lengths of a realistic, prefill-heavy mix: lognormal with median SHAREGPT_MEDIAN and
    sigma SHAREGPT_SIGMA, clipped to SHAREGPT_RANGE; the same seed gives the same lengths."""
    draw = random.Random(seed)
    low, high = SHAREGPT_RANGE
    return tuple(min(max(round(draw.lognormvariate(math.log(SHAREGPT_MEDIAN), SHAREGPT_SIGMA)), low), high)
                 for _ in range(count))


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


def rollout_contender(
    model: Any, route: str, sampling: SamplingConfig, costs: Any = None, tokenizer: Any = None
) -> Contender:
    """One route as a contender: prompts -> (tokens, profile dict); the `Rollout` is built once. A benchmark
    owns its process, so each run resets the peak-memory mark first: the profile's peak is that run's."""
    from autobucket.engine.rollout import Rollout

    rollout = Rollout(model, tokenizer, RolloutConfig(route=route, costs=costs))

    def run(prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, Any]]:
        reset_peak_memory(rollout.device)
        result = rollout.generate(prompts, sampling)
        return result.tokens, result.profile.to_dict()

    return run


def reporting(contenders: dict[str, Contender], done: Callable[[str], None]) -> dict[str, Contender]:
    """The same contenders, each calling `done(name)` after every run (for a progress bar)."""

    def wrap(name: str, contender: Contender) -> Contender:
        def run(prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, Any] | None]:
            outcome = contender(prompts)
            done(name)
            return outcome

        return run

    return {name: wrap(name, contender) for name, contender in contenders.items()}


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
