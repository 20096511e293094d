"""Calibration: measure what prefill and decode cost on this model and device, then fit `CostCoefficients`.

What is measured (see `timing` for how):

* **Prefill** of uniform (B, L) shapes through the engine's `ModelRunner.prefill` + `.insert`: the forward
  and the KV copy of the same run. The forward alone is what ordinary `generate` pays; forward + copy is
  the bucketed path. Timing them separately identifies ``kv_ms`` directly.
* **Decode**: HF `generate` and the CB loop on the same uniform batch, per-step medians.
* **Packed prefill** of B prompts of L tokens concatenated in one row (`ModelRunner.prefill` in the packed
  form + `.insert`), interleaved with the rest: it fits ``packed_prompt_ms`` (see `costs.packed_fit`).
* **Held-out shapes** are measured like the fitted ones but never fitted: their error says how well the
  coefficients predict shapes they have not seen.

Built for a busy machine: every round visits every shape once (in a rotating order), so a slow phase of
the machine hits all shapes alike; each shape's value is the median of its samples after outlier
rejection; measuring stops at `max_seconds` whatever is left, and a fit whose shapes were too noisy (or
whose held-out error is too large) is refused naming those shapes and what to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autobucket.costs.calibration.plans import (
    DEFAULT_MAX_SECONDS,
    MAX_HOLDOUT_ERROR,
    MAX_SPREAD,
    CalibrationPlan,
    Shape,
    default_plan,
    packed_shapes_for,
    quick_plan,
)
from autobucket.costs.calibration.timing import (
    WorkClock,
    robust_median,
    shape_prompts,
    spread,
    time_decode_steps,
    time_prefill_insert,
)
from autobucket.costs.coefficients import CostCoefficients, ModelGeometry
from autobucket.costs.fit import MAX_MEDIAN_ERROR, DecodePoint, FitReport, PrefillPoint, fit_costs
from autobucket.costs.packed_fit import PackedPoint
from autobucket.engine.batching.packed_prefill import packing_attention
from autobucket.planning.forms import PACKED, PADDED

Progress = Callable[[str], None]  # called after each measured shape with a description of it

__all__ = [
    "DEFAULT_MAX_SECONDS", "MAX_HOLDOUT_ERROR", "MAX_SPREAD", "Calibration", "CalibrationPlan", "Shape",
    "calibrate", "default_plan", "fit_measurements", "measure", "measurement_problems", "model_geometry",
    "packed_shapes_for", "quick_fit", "quick_plan",
]
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
    from autobucket.costs.calibration_file import calibration_metadata

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
    ]
    packed = [PackedPoint(item["rows"], item["width"], item["attention"], robust_median(item["kv_copy_ms"]))
              for item in measurements.get("packed", []) if item["kv_copy_ms"]]
    return fit_costs(prefill, decode, geometry, max_median_error, packed)


# ---------------------------------------------------------------------------------------------- measuring
def measure(model: torch.nn.Module, plan: CalibrationPlan, step: Progress) -> dict[str, Any]:
    """Raw samples of every shape, in rounds that visit each shape once (rotating order), within
    `plan.max_seconds`: a round starts only if the last one's duration still fits, and a sample only if
    its estimated duration (its tokens at the ms per token seen so far) does, so every shape keeps the same
    number of samples and measuring ends by the deadline; shapes left unmeasured are named by the fit."""
    items = ([("prefill", s, False) for s in plan.prefill_shapes] + [("prefill", s, True) for s in plan.holdout_shapes]
             + [("decode", s, False) for s in plan.decode_shapes] + [("packed", s, False) for s in plan.packed_shapes])
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
                  "plain_ms": [], "insert_ms": [], "kv_copy_ms": []}
        return record if kind == "prefill" else {**record, "attention": None}
    return {"kind": kind, "rows": shape.rows, "width": shape.width, "new_tokens": plan.decode_new_tokens,
            "steps": plan.decode_new_tokens - 1, "cb_includes_copy": False, "cb_step_ms": [], "ordinary_step_ms": []}


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
              "more time (--max-seconds) or fewer shapes (--quick)")
    items = measurements["prefill"] + measurements["decode"] + measurements.get("packed", [])
    short = [_label(i) for i in items if not i.get("plain_ms", i.get("cb_step_ms"))]
    noisy = sorted(items, key=_spread, reverse=True)
    noisy_text = ", ".join(f"{_label(i)} ({_spread(i):.0%})" for i in noisy[:4] if _spread(i) > MAX_SPREAD)
    worst = sorted((r for r in report.rows if r.kind != "decode"), key=lambda r: -abs(r.relative_error))
    worst_text = ", ".join(f"{r.rows}:{r.width}{' held out' if r.holdout else ''} ({r.relative_error:+.0%})"
                           for r in worst[:4])
    cause = f"; noisy shapes (spread > {MAX_SPREAD:.0%}): {noisy_text}" if noisy_text else ""
    cause += f"; worst-predicted prefill shapes: {worst_text}" if worst_text else ""
    problems = []
    if short:
        listed = ", ".join(short[:5]) + (f" and {len(short) - 5} more" if len(short) > 5 else "")
        problems.append(f"{plan.max_seconds:.0f} s measured only {len(items) - len(short)} of {len(items)} shapes "
                        f"(not measured: {listed}): use --quick, or raise --max-seconds")
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
