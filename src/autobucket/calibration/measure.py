"""Calibration: measure what prefill and decode cost on this model and device, then fit `CostCoefficients`.

What is measured, and why:

* **Prefill** of uniform (B, L) shapes on two paths, interleaved per shape so that a slow phase of the
  machine hits both alike: (a) the plain forward (`prefill_bucket`, what ordinary `generate` runs first) and
  (b) the same forward plus the copy into a `StaticKVCache` (`admit`), the engine's bucketed-prefill path.
  Both are needed: on (b) alone the per-token and KV-copy terms are collinear (both ∝ B·L).
* **Decode**: the same uniform batch through route "ordinary" (HF `generate`) and route "equal_width"
  (the CB loop), per step = (call − prefill) / decode forwards. The CB side still holds its KV copy, which
  the fit removes (`calibration_fit`). Per-call constants (HF's generation setup, allocating the static
  cache) are spread over the steps, so decode is measured at the budget the workload uses
  (`decode_new_tokens`, 16 by default like the sweep).
* **Held-out shapes** are measured like the fitted ones but never fitted: their error says how well the
  coefficients predict shapes they have not seen.

Every timing is the median of `repeats` after `warmup` runs, with the device synchronised (CUDA).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autobucket.coefficients.fit import MAX_MEDIAN_ERROR, DecodePoint, FitReport, PrefillPoint, fit_costs
from autobucket.engine.hf_compat import forward_spec
from autobucket.engine.prefill import prefill_bucket
from autobucket.engine.static_cache import StaticKVCache
from autobucket.planning.costs import CostCoefficients, ModelGeometry
from autobucket.prompts import random_prompts

Progress = Callable[[str], None]  # called after each measured shape with a description of it
DEFAULT_MAX_LENGTH = 512
DEFAULT_MAX_SHAPE_TOKENS = 16384  # largest B·L of the default grid (32 × 512)


@dataclass(frozen=True)
class Shape:
    rows: int  # B
    width: int  # L, tokens per prompt (uniform)

    def __str__(self) -> str:
        return f"{self.rows}:{self.width}"


@dataclass(frozen=True)
class CalibrationPlan:
    """What `calibrate` measures."""

    prefill_shapes: tuple[Shape, ...]
    holdout_shapes: tuple[Shape, ...] = ()
    decode_shapes: tuple[Shape, ...] = ()
    decode_new_tokens: int = 16
    repeats: int = 5
    warmup: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("repeats", "warmup", "decode_new_tokens"):
            value = getattr(self, name)
            minimum = {"repeats": 1, "warmup": 0, "decode_new_tokens": 2}[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}={value!r} is invalid: expected an int >= {minimum}")
        if not self.prefill_shapes:
            raise ValueError("prefill_shapes is empty: give at least one B:L shape to measure")

    @property
    def items(self) -> int:
        return len(self.prefill_shapes) + len(self.holdout_shapes) + len(self.decode_shapes)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("prefill_shapes", "holdout_shapes", "decode_shapes"):
            data[name] = [str(shape) for shape in getattr(self, name)]
        return data


def default_plan(
    max_positions: int | None,
    max_length: int | None = None,
    repeats: int = 5,
    decode_new_tokens: int = 16,
    max_shape_tokens: int = DEFAULT_MAX_SHAPE_TOKENS,
) -> CalibrationPlan:
    """Short, typical and long prompts up to ``max_length`` (default: min(512, context)), B from 1 to 32.

    Held-out shapes sit between the fitted ones (other batch sizes, widths at 3/4 of a fitted width).
    """
    longest = _default_max_length(max_positions, max_length, decode_new_tokens)

    def grid(fractions: Sequence[float], batches: Sequence[int]) -> tuple[Shape, ...]:
        widths = sorted({max(1, round(longest * f)) for f in fractions})
        return tuple(Shape(b, w) for b in batches for w in widths if b * w <= max_shape_tokens)

    fitted = grid((1 / 128, 1 / 32, 1 / 8, 1 / 4, 1 / 2, 1), (1, 4, 16, 32))
    holdout = grid((3 / 64, 3 / 16, 3 / 8, 3 / 4), (2, 8, 24))
    decode = tuple(
        Shape(b, max(1, round(longest * f)))
        for b, f in ((32, 1 / 32), (8, 1 / 4), (32, 1 / 4), (8, 1), (32, 1))
    )
    return CalibrationPlan(fitted, holdout, tuple(dict.fromkeys(decode)), decode_new_tokens, repeats)


def quick_plan(max_positions: int | None, repeats: int = 2) -> CalibrationPlan:
    """A small grid (~20–40 s on the 20.3M CPU model): enough for every coefficient, no held-out shapes."""
    longest = _default_max_length(max_positions, None, 16)
    widths = sorted({max(1, round(longest * f)) for f in (1 / 32, 1 / 8, 1 / 2, 1)})
    prefill = tuple(Shape(b, w) for b in (1, 8, 32) for w in widths)
    decode = (Shape(32, widths[0]), Shape(8, longest), Shape(32, longest))
    return CalibrationPlan(prefill, (), decode, 16, repeats)


def _default_max_length(max_positions: int | None, max_length: int | None, new_tokens: int) -> int:
    if max_length is not None:
        if max_positions is not None and max_length + new_tokens > max_positions:
            raise ValueError(
                f"max_length={max_length} + {new_tokens} new tokens exceeds the model's context of "
                f"{max_positions} positions: lower --max-length"
            )
        return max_length
    if max_positions is None:
        return DEFAULT_MAX_LENGTH
    return max(1, min(DEFAULT_MAX_LENGTH, max_positions - new_tokens))


@dataclass
class Calibration:
    costs: CostCoefficients
    report: FitReport
    metadata: dict[str, Any]
    plan: CalibrationPlan
    measurements: dict[str, Any] = field(default_factory=dict)  # raw samples (JSON-ready)


def calibrate(
    model: torch.nn.Module,
    plan: CalibrationPlan,
    model_name: str = "",
    progress: Progress | None = None,
    max_median_error: float = MAX_MEDIAN_ERROR,
) -> Calibration:
    """Measure `plan` on `model` and fit the coefficients; check `result.report.ok` before trusting them."""
    from autobucket.coefficients.file import calibration_metadata

    metadata = calibration_metadata(model, model_name)
    step = progress or (lambda description: None)
    prefill = []
    for holdout, shapes in ((False, plan.prefill_shapes), (True, plan.holdout_shapes)):
        for shape in shapes:
            prefill.append({**measure_prefill(model, shape, plan), "holdout": holdout})
            step(f"prefill {shape}{' (held out)' if holdout else ''}")
    decode = []
    for shape in plan.decode_shapes:
        decode.append(measure_decode(model, shape, plan))
        step(f"decode {shape}")
    measurements = {"prefill": prefill, "decode": decode}
    report = fit_measurements(measurements, model_geometry(model), max_median_error)
    return Calibration(report.costs, report, metadata, plan, measurements)


def quick_fit(model: torch.nn.Module, repeats: int = 2, progress: Progress | None = None) -> CostCoefficients:
    """Coefficients from `quick_plan` (for benchmarks' ``--fit``); raises ValueError if the fit is refused."""
    result = calibrate(model, quick_plan(model_geometry(model).max_positions, repeats), progress=progress)
    if not result.report.ok:
        raise ValueError("quick calibration refused: " + "; ".join(result.report.problems))
    return result.costs


def model_geometry(model: torch.nn.Module) -> ModelGeometry:
    return ModelGeometry.from_config(model.config, next(model.parameters()).dtype)


def fit_measurements(
    measurements: dict[str, Any], geometry: ModelGeometry, max_median_error: float = MAX_MEDIAN_ERROR
) -> FitReport:
    """Medians of the raw samples -> `fit_costs` (also refits a saved calibration's measurements)."""
    prefill = []
    for item in measurements["prefill"]:
        for kv_copy, key in ((False, "plain_ms"), (True, "kv_copy_ms")):
            median = statistics.median(item[key])
            prefill.append(PrefillPoint(item["rows"], item["width"], kv_copy, median, item["holdout"]))
    decode = [
        DecodePoint(item["rows"], item["width"], item["steps"], statistics.median(item["cb_step_ms"]),
                    statistics.median(item["ordinary_step_ms"]))
        for item in measurements["decode"]
    ]  # fmt: skip
    return fit_costs(prefill, decode, geometry, max_median_error)


# ---------------------------------------------------------------------------------------------- prefill
def measure_prefill(model: torch.nn.Module, shape: Shape, plan: CalibrationPlan) -> dict[str, Any]:
    """ms of the plain prefill forward and of forward + cache copy, alternating, after warm-up."""
    spec = forward_spec(model)
    prompts = random_prompts([shape.width] * shape.rows, _vocab_size(model), seed=plan.seed)
    columns = shape.width + plan.decode_new_tokens
    samples: dict[str, list[float]] = {"plain_ms": [], "kv_copy_ms": []}
    for repeat in range(plan.warmup + plan.repeats):
        order = ("plain_ms", "kv_copy_ms") if repeat % 2 == 0 else ("kv_copy_ms", "plain_ms")
        for key in order:
            elapsed_ms = _time_prefill(model, spec, prompts, columns, copy=key == "kv_copy_ms")
            if repeat >= plan.warmup:
                samples[key].append(elapsed_ms)
    return {"rows": shape.rows, "width": shape.width, **samples}


@torch.inference_mode()  # as `ContinuousBatcher.run`
def _time_prefill(
    model: torch.nn.Module, spec: Any, prompts: list[list[int]], columns: int, copy: bool
) -> float:
    """One prefill as the engine runs it (`ContinuousBatcher._prefill`, `_start_samples`, `_insert`):
    forward, first tokens read to the host, then (copy) the K/V copied right-aligned into a fresh static
    cache (every row kept, one sample per prompt: the engine copies without a gather then)."""
    device = next(model.parameters()).device
    store = _static_cache(model, len(prompts), columns) if copy else None
    _synchronize(device)
    started = time.perf_counter()
    output = prefill_bucket(model, spec, prompts, pad_token_id=0)
    output.last_logits.argmax(dim=-1).tolist()  # first tokens: the engine's host read (a device sync)
    if store is not None:
        store.admit(output.keys, output.values, [len(p) for p in prompts])
    _synchronize(device)
    return (time.perf_counter() - started) * 1e3


def _static_cache(model: torch.nn.Module, rows: int, columns: int) -> StaticKVCache:
    geometry = model_geometry(model)
    parameter = next(model.parameters())
    return StaticKVCache(
        num_layers=geometry.layers, rows=rows, kv_heads=geometry.kv_heads, columns=columns,
        head_dim=geometry.head_dim, dtype=parameter.dtype, device=parameter.device,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- decode
def measure_decode(model: torch.nn.Module, shape: Shape, plan: CalibrationPlan) -> dict[str, Any]:
    """Per-step ms of HF `generate`'s decode and of the CB loop's, on one uniform batch."""
    from autobucket.config import RolloutConfig, SamplingConfig
    from autobucket.engine.rollout import Rollout

    prompts = random_prompts([shape.width] * shape.rows, _vocab_size(model), seed=plan.seed)
    sampling = SamplingConfig(max_new_tokens=plan.decode_new_tokens, continuous_batch_size=shape.rows)
    # profile=True: phase timers synchronise a CUDA device, so prefill_ms is the prefill's own time.
    rollouts = {
        "ordinary_step_ms": Rollout(model, config=RolloutConfig(route="ordinary", profile=True)),
        "cb_step_ms": Rollout(model, config=RolloutConfig(route="equal_width", profile=True)),
    }
    samples: dict[str, list[float]] = {key: [] for key in rollouts}
    steps = 0
    for repeat in range(plan.warmup + plan.repeats):
        for key, rollout in rollouts.items():
            started = time.perf_counter()
            profile = rollout.generate(prompts, sampling).profile
            call_ms = (time.perf_counter() - started) * 1e3
            steps = profile.decode_forwards
            if repeat >= plan.warmup and steps > 0:
                samples[key].append((call_ms - profile.prefill_ms) / steps)
    if not samples["cb_step_ms"]:
        raise ValueError(
            f"decode shape {shape}: every row stopped at its first token (EOS); no decode step to time"
        )
    return {
        "rows": shape.rows,
        "width": shape.width,
        "new_tokens": plan.decode_new_tokens,
        "steps": steps,
        **samples,
    }


def _vocab_size(model: torch.nn.Module) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
