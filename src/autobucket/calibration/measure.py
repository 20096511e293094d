"""Calibration: measure what prefill and decode cost on this model and device, then fit `CostCoefficients`.

What is measured (see `timing` for how):

* **Prefill** of uniform (B, L) shapes through the engine's `ModelRunner.prefill` + `.insert`: the forward
  and the KV copy of the same run. The forward alone is what ordinary `generate` pays; forward + copy is
  the bucketed path. Timing them separately identifies ``kv_ms`` directly.
* **Decode**: HF `generate` and the CB loop on the same uniform batch, per-step medians.
* **Packed prefill** of B prompts of L tokens concatenated in one row (`ModelRunner.prefill` in the packed
  form + `.insert`), interleaved with the rest: it fits ``packed_prompt_ms`` (see `coefficients.packed_fit`).
* **Held-out shapes** are measured like the fitted ones but never fitted: their error says how well the
  coefficients predict shapes they have not seen.

Built for a busy machine: every round visits every shape once (in a rotating order), so a slow phase of
the machine hits all shapes alike; each shape's value is the median of its samples after outlier
rejection; measuring stops at `max_seconds` whatever is left, and a fit whose shapes were too noisy (or
whose held-out error is too large) is refused naming those shapes and what to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autobucket.calibration.timing import (
    WorkClock,
    robust_median,
    shape_prompts,
    spread,
    time_decode_steps,
    time_prefill_insert,
)
from autobucket.coefficients.fit import MAX_MEDIAN_ERROR, DecodePoint, FitReport, PrefillPoint, fit_costs
from autobucket.coefficients.packed_fit import PackedPoint
from autobucket.engine.packed_prefill import packing_attention
from autobucket.planning.costs import CostCoefficients, ModelGeometry
from autobucket.planning.forms import PACKED, PADDED, FormCosts

Progress = Callable[[str], None]  # called after each measured shape with a description of it
DEFAULT_MAX_LENGTH = 512
DEFAULT_MAX_SHAPE_TOKENS = 16384  # largest B·L of the default grid (32 × 512)
DEFAULT_MAX_SECONDS = 60.0  # measuring stops here, finished or not
MAX_SPREAD = 0.25  # a shape whose samples spread more than this (scaled MAD / median) is noisy
MAX_HOLDOUT_ERROR = 0.2  # a fit whose held-out median error exceeds this is refused


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
    max_seconds: float = DEFAULT_MAX_SECONDS
    packed_shapes: tuple[Shape, ...] = ()  # B prompts of L tokens packed in one row (fits packed_prompt_ms)

    def __post_init__(self) -> None:
        if not (isinstance(self.max_seconds, (int, float)) and self.max_seconds > 0):
            raise ValueError(f"max_seconds={self.max_seconds!r} is invalid: expected seconds > 0")
        for name in ("repeats", "warmup", "decode_new_tokens"):
            value = getattr(self, name)
            minimum = {"repeats": 1, "warmup": 0, "decode_new_tokens": 2}[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}={value!r} is invalid: expected an int >= {minimum}")
        if not self.prefill_shapes:
            raise ValueError("prefill_shapes is empty: give at least one B:L shape to measure")

    @property
    def items(self) -> int:
        return len(self.prefill_shapes) + len(self.holdout_shapes) + len(self.decode_shapes) + len(self.packed_shapes)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("prefill_shapes", "holdout_shapes", "decode_shapes", "packed_shapes"):
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
    return CalibrationPlan(fitted, holdout, tuple(dict.fromkeys(decode)), decode_new_tokens, repeats,
                           packed_shapes=packed_shapes_for(fitted))  # fmt: skip


def packed_shapes_for(shapes: Sequence[Shape]) -> tuple[Shape, ...]:
    """The shapes of `shapes` worth packing: at least 2 prompts, within the planner's packed-row bound."""
    limit = FormCosts().packed_max_tokens or DEFAULT_MAX_SHAPE_TOKENS
    return tuple(shape for shape in shapes if shape.rows >= 2 and shape.rows * shape.width <= limit)


def quick_plan(max_positions: int | None, repeats: int = 3, max_seconds: float = DEFAULT_MAX_SECONDS) -> CalibrationPlan:
    """A small grid: every coefficient, two held-out shapes, at most 512 tokens per forward and short
    decode calls (~2,500 prompt tokens a round), so SmolLM2-135M gets rounds in within a minute on one
    busy CPU core."""
    longest = min(128, _default_max_length(max_positions, None, 8))
    widths = sorted({max(1, round(longest * f)) for f in (1 / 16, 1 / 4, 1)})
    prefill = tuple(Shape(b, w) for b in (1, 4, 16) for w in widths if b * w <= 512)
    holdout = tuple(Shape(b, max(1, longest // d)) for b, d in ((2, 2), (8, 8), (1, 2), (4, 8)))
    decode = (Shape(4, widths[0]), Shape(8, widths[1]))
    return CalibrationPlan(prefill, holdout, decode, 6, repeats, warmup=0, max_seconds=max_seconds,
                           packed_shapes=packed_shapes_for(prefill))  # fmt: skip


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
    max_holdout_error: float = MAX_HOLDOUT_ERROR,
) -> Calibration:
    """Measure `plan` on `model` and fit the coefficients; check `result.report.ok` before trusting them."""
    from autobucket.coefficients.file import calibration_metadata

    metadata = calibration_metadata(model, model_name)
    measurements = measure(model, plan, progress or (lambda description: None))
    report = fit_measurements(measurements, model_geometry(model), max_median_error)
    report.problems += measurement_problems(measurements, report, plan, max_holdout_error)
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
    """Robust medians of the raw samples -> `fit_costs` (also refits a saved calibration's measurements)."""
    prefill = []
    for item in measurements["prefill"]:
        for kv_copy, key in ((False, "plain_ms"), (True, "kv_copy_ms")):
            if item[key]:
                prefill.append(PrefillPoint(item["rows"], item["width"], kv_copy, robust_median(item[key]), item["holdout"]))
    decode = [
        DecodePoint(item["rows"], item["width"], item["steps"], robust_median(item["cb_step_ms"]),
                    robust_median(item["ordinary_step_ms"]), item.get("cb_includes_copy", True))
        for item in measurements["decode"] if item["cb_step_ms"]
    ]  # fmt: skip
    packed = [PackedPoint(item["rows"], item["width"], item["attention"], robust_median(item["kv_copy_ms"]))
              for item in measurements.get("packed", []) if item["kv_copy_ms"]]  # fmt: skip
    return fit_costs(prefill, decode, geometry, max_median_error, packed)


# ---------------------------------------------------------------------------------------------- measuring
def measure(model: torch.nn.Module, plan: CalibrationPlan, step: Progress) -> dict[str, Any]:
    """Raw samples of every shape, in rounds that visit each shape once (rotating order), within
    `plan.max_seconds`: a round starts only if the last one's duration still fits, and a sample only if
    its estimated duration (its tokens at the ms per token seen so far) does, so every shape keeps the same
    number of samples and measuring ends by the deadline; shapes left unmeasured are named by the fit."""
    items = ([("prefill", s, False) for s in plan.prefill_shapes] + [("prefill", s, True) for s in plan.holdout_shapes]
             + [("decode", s, False) for s in plan.decode_shapes] + [("packed", s, False) for s in plan.packed_shapes])  # fmt: skip
    items.sort(key=lambda item: -_work(item[0], item[1], plan))  # most work first: later overruns are small
    records = [_empty_record(kind, shape, holdout, plan) for kind, shape, holdout in items]
    prompts = [shape_prompts(shape.rows, shape.width, model, plan.seed) for _, shape, _ in items]
    started = time.perf_counter()
    deadline, round_s, completed, clock = started + plan.max_seconds, 0.0, 0, WorkClock()
    # Warm-up (first-touch allocations, lazy initialisation) on the smallest shape, untimed: its ms per
    # token is mostly fixed cost and would forbid every large sample.
    for _ in range(plan.warmup):
        time_prefill_insert(model, prompts[-1], plan.decode_new_tokens)
    for round_index in range(plan.repeats):
        if time.perf_counter() + round_s > deadline:
            break
        round_started = time.perf_counter()
        for offset in range(len(items)):
            position = (offset + round_index) % len(items)
            kind, shape, holdout = items[position]
            if time.perf_counter() + clock.estimate_s(_work(kind, shape, plan)) > deadline:
                return _measurements(records, completed, started)
            with clock.timing(_work(kind, shape, plan)):
                _sample(model, kind, prompts[position], records[position], plan)
            if round_index == 0:
                step(f"{kind} {shape}{' (held out)' if holdout else ''}")
        round_s, completed = time.perf_counter() - round_started, completed + 1
    return _measurements(records, completed, started)


def _work(kind: str, shape: Shape, plan: CalibrationPlan) -> float:
    """Token positions one sample runs: a prefill forward, or (decode) two calls' prefills and steps."""
    if kind in ("prefill", "packed"):
        return shape.rows * shape.width
    return 2 * shape.rows * (shape.width + plan.decode_new_tokens)


def _empty_record(kind: str, shape: Shape, holdout: bool, plan: CalibrationPlan) -> dict[str, Any]:
    if kind in ("prefill", "packed"):
        record = {"kind": kind, "rows": shape.rows, "width": shape.width, "holdout": holdout,
                  "plain_ms": [], "insert_ms": [], "kv_copy_ms": []}  # fmt: skip
        return record if kind == "prefill" else {**record, "attention": None}
    return {"kind": kind, "rows": shape.rows, "width": shape.width, "new_tokens": plan.decode_new_tokens,
            "steps": plan.decode_new_tokens - 1, "cb_includes_copy": False, "cb_step_ms": [], "ordinary_step_ms": []}  # fmt: skip


def _sample(model: torch.nn.Module, kind: str, prompts: list[list[int]], record: dict, plan: CalibrationPlan) -> None:
    if kind in ("prefill", "packed"):
        form = PACKED if kind == "packed" else PADDED
        if kind == "packed":
            record["attention"] = packing_attention(model)  # what the packed forward's attention work is
        forward_ms, insert_ms = time_prefill_insert(model, prompts, plan.decode_new_tokens, form)
        record["plain_ms"].append(forward_ms)
        record["insert_ms"].append(insert_ms)
        record["kv_copy_ms"].append(forward_ms + insert_ms)
    else:
        for key, value in time_decode_steps(model, prompts, plan.decode_new_tokens).items():
            record[key].append(value)


def _measurements(records: list[dict[str, Any]], rounds: int, started: float) -> dict[str, Any]:
    prefill = [{k: v for k, v in r.items() if k != "kind"} for r in records if r["kind"] == "prefill"]
    decode = [{k: v for k, v in r.items() if k != "kind"} for r in records if r["kind"] == "decode"]
    packed = [{k: v for k, v in r.items() if k != "kind"} for r in records if r["kind"] == "packed"]
    return {"prefill": prefill, "decode": decode, "packed": packed, "rounds": rounds, "seconds": time.perf_counter() - started}


def measurement_problems(
    measurements: dict[str, Any], report: FitReport, plan: CalibrationPlan, max_holdout_error: float = MAX_HOLDOUT_ERROR
) -> list[str]:
    """Why a fit from these measurements should not be trusted: shapes left with fewer than 2 samples, or a
    held-out error above `max_holdout_error`; each names the noisiest shapes and what to do."""
    advice = ("rerun with --threads 1 pinned to one core (taskset -c 0), on a quieter machine, or give it "
              "more time (--max-seconds) or fewer shapes (--quick)")  # fmt: skip
    items = measurements["prefill"] + measurements["decode"] + measurements.get("packed", [])
    short = [_label(i) for i in items if not i.get("plain_ms", i.get("cb_step_ms"))]
    noisy = sorted(items, key=_spread, reverse=True)
    noisy_text = ", ".join(f"{_label(i)} ({_spread(i):.0%})" for i in noisy[:4] if _spread(i) > MAX_SPREAD)
    worst = sorted((r for r in report.rows if r.kind != "decode"), key=lambda r: -abs(r.relative_error))
    worst_text = ", ".join(f"{r.rows}:{r.width}{' held out' if r.holdout else ''} ({r.relative_error:+.0%})"
                           for r in worst[:4])  # fmt: skip
    cause = f"; noisy shapes (spread > {MAX_SPREAD:.0%}): {noisy_text}" if noisy_text else ""
    cause += f"; worst-predicted prefill shapes: {worst_text}" if worst_text else ""
    problems = []
    if short:
        listed = ", ".join(short[:5]) + (f" and {len(short) - 5} more" if len(short) > 5 else "")
        problems.append(f"{plan.max_seconds:.0f} s measured only {len(items) - len(short)} of {len(items)} shapes "
                        f"(not measured: {listed}): use --quick, or raise --max-seconds")  # fmt: skip
    held_out = report.median_error(holdout=True)
    if held_out is None and measurements.get("rounds", 2) < 2:
        problems.append(f"one round of samples and no held-out shapes: nothing validates the fit: {advice}")
    if held_out is not None and held_out > max_holdout_error:
        problems.append(f"the median error on held-out shapes is {held_out:.0%} (> {max_holdout_error:.0%}){cause}: {advice}")
    elif report.problems and cause:
        problems.append(cause.removeprefix("; ") + f": {advice}")
    return problems


def _label(item: dict[str, Any]) -> str:
    kind = "decode" if "cb_step_ms" in item else "packed" if "attention" in item else "prefill"
    return f"{kind} {item['rows']}:{item['width']}"


def _spread(item: dict[str, Any]) -> float:
    keys = ("plain_ms", "insert_ms") if "plain_ms" in item else ("cb_step_ms", "ordinary_step_ms")
    return max(spread(item[key]) for key in keys)
