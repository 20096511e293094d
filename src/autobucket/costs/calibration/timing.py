"""Timing the engine's own steps for calibration, robustly enough for a busy machine.

* **Prefill**: `ModelRunner.prefill` then `ModelRunner.insert`, the exact calls the continuous batcher
  makes for a bucket, timed separately from one run: the forward (what ordinary `generate` runs first too)
  and the KV copy into a static cache that already holds a first admission (so the copy is timed, not the
  allocation the first admission of a call also pays).
* **Decode**: one call of route "ordinary" (HF `generate`) and one of "equal_width" (the CB loop) on the
  same uniform batch; the per-step times are the medians of the call's own decode-step timings (see
  `Profile.timings`), so a step slowed by another job does not move them.

`robust_median` drops samples beyond `OUTLIER_MADS` scaled MADs (log scale) before taking the median, and
`spread` (the scaled MAD relative to the median) says how noisy a shape was.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from contextlib import contextmanager

import torch

from autobucket.costs.coefficients import CB_STEP, ORDINARY_STEP, CostCoefficients
from autobucket.engine.batching.model_runner import CacheShape, ModelRunner, RowInsert
from autobucket.engine.model_access.hf_compat import forward_spec
from autobucket.planning.forms import PADDED
from autobucket.prompts import random_prompts

OUTLIER_MADS = 3.0


def vocab_size(model: torch.nn.Module) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


@torch.inference_mode()
def time_prefill_insert(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, form: str = PADDED
) -> tuple[float, float]:
    """(forward ms, KV-copy ms) of one padded group (or packed group: `form`) through the engine's `ModelRunner`."""
    rows, width = len(prompts), max(len(p) for p in prompts)
    device = next(model.parameters()).device
    runner = ModelRunner(model, forward_spec(model), CacheShape(2 * rows, width + new_tokens), 0,
                         vocab_size(model), track_seen=False)
    lengths, first = [len(p) for p in prompts], torch.zeros(rows, dtype=torch.long, device=device)
    _synchronize(device)
    started = time.perf_counter()
    output, _ = runner.prefill(prompts, form)
    _synchronize(device)
    forward_ms = (time.perf_counter() - started) * 1e3
    runner.insert(output, RowInsert(list(range(rows)), first, lengths, None))  # allocates the cache
    _synchronize(device)
    started = time.perf_counter()
    runner.insert(output, RowInsert(list(range(rows)), first, lengths, None))  # the timed copy
    _synchronize(device)
    return forward_ms, (time.perf_counter() - started) * 1e3


def time_decode_steps(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Median per-step ms of HF `generate` ("ordinary_step_ms") and of the CB loop ("cb_step_ms")."""
    from autobucket.config import RolloutConfig, SamplingConfig
    from autobucket.engine.rollout import Rollout

    sampling = SamplingConfig(max_new_tokens=new_tokens, continuous_batch_size=len(prompts), eos_token_id=[])
    medians = {}
    for key, route, kind in (("ordinary_step_ms", "ordinary", ORDINARY_STEP), ("cb_step_ms", "equal_width", CB_STEP)):
        # Fixed coefficients: calibration must not feed (or probe for) the online learner.
        rollout = Rollout(model, config=RolloutConfig(route=route, costs=CostCoefficients(), profile=True))
        steps = [t.ms for t in rollout.generate(prompts, sampling).profile.timings if t.kind == kind]
        medians[key] = statistics.median(steps)
    return medians


def shape_prompts(rows: int, width: int, model: torch.nn.Module, seed: int) -> list[list[int]]:
    return random_prompts([width] * rows, vocab_size(model), seed=seed)


def inliers(samples: Sequence[float]) -> list[float]:
    """Samples within OUTLIER_MADS scaled MADs of the median, on a log scale (all of them if < 3)."""
    if len(samples) < 3:
        return list(samples)
    logs = [math.log(max(s, 1e-6)) for s in samples]
    centre = statistics.median(logs)
    mad = 1.4826 * statistics.median(abs(x - centre) for x in logs)
    return [s for s, x in zip(samples, logs, strict=True) if abs(x - centre) <= max(OUTLIER_MADS * mad, 0.05)]


def robust_median(samples: Sequence[float]) -> float:
    return statistics.median(inliers(samples))


def spread(samples: Sequence[float]) -> float:
    """Scaled MAD over median: ~ the relative standard deviation for Gaussian noise (0 below 2 samples)."""
    if len(samples) < 2:
        return 0.0
    centre = statistics.median(samples)
    return 1.4826 * statistics.median(abs(s - centre) for s in samples) / max(centre, 1e-9)


class WorkClock:
    """Seconds per token position seen so far, to estimate whether a sample still fits."""

    def __init__(self) -> None:
        self.work, self.seconds = 0.0, 0.0

    def estimate_s(self, work: float) -> float:
        return 0.0 if self.work == 0 else self.seconds / self.work * work

    @contextmanager
    def timing(self, work: float):
        started = time.perf_counter()
        yield
        self.work, self.seconds = self.work + work, self.seconds + time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
