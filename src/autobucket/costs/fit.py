"""Fitting `CostCoefficients` to calibration measurements (numpy + scipy, never torch).

**Prefill.** A prefill forward of B rows at width L is modelled as
``fixed + token·B·L + attention·GFLOPs(B, L) + kv·MiB(B, L)``, where the KV term is the copy into the
continuous-batching cache. Measured on the engine's bucketed path alone, ``token`` and ``kv`` are
collinear (both ∝ B·L), so calibration also measures the plain prefill forward, whose KV column is 0.
Rows are weighted by 1/measured, so the least-squares problem minimises *relative* error and small shapes
(where ``fixed`` dominates) count as much as large ones.

**Decode.** The per-step difference CB − ordinary is ``decode_ms − ordinary_decode_ms −
ordinary_decode_kv_ms·MiB(B, mean context)``: columns (+1, −1, −MiB), all coefficients >= 0. The +1 and
−1 columns are deliberately opposite (only their difference is identified; NNLS leaves at most one of
them non-zero), so the rank that matters is that of (1, MiB): at least two distinct cache sizes.

A fit is *refused* (``FitReport.problems``) rather than saved when it cannot be trusted: fewer shapes
than coefficients, a design matrix of insufficient rank, all prefill coefficients zero, or a median
relative error over 50%.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import nnls

from autobucket.costs.coefficients import (
    CostCoefficients,
    ModelGeometry,
    attention_gflops,
    kv_mib,
    prefill_cost_ms,
)
from autobucket.costs.packed_fit import PackedPoint, fit_packed_prompt_ms, predict_packed_ms

PREFILL_TERMS = ("fixed_ms", "token_ms", "attention_ms", "kv_ms")
DECODE_TERMS = ("decode_ms", "ordinary_decode_ms", "ordinary_decode_kv_ms")
SHARED_TERMS = ("step_ms", "step_row_ms", "step_kv_ms")
EXTENSION_TERM = "forward_sq_ms"  # kept only when it lowers the held-out error (see _with_extension_if_better)
MAX_MEDIAN_ERROR = 0.5  # a fit whose median relative error is worse than this is refused
_RANK_TOLERANCE = 1e-9  # relative singular value below which a (column-normalised) direction is missing
_MIN_SCALE_MS = 1e-6  # relative errors are taken relative to at least this (a 0 ms reading stays finite)


@dataclass(frozen=True)
class PrefillPoint:
    """Median ms of one prefill shape; ``kv_copy``: the engine path (forward + copy into the cache)."""

    rows: int
    width: int
    kv_copy: bool
    measured_ms: float
    holdout: bool = False  # measured for validation only, never fitted


@dataclass(frozen=True)
class DecodePoint:
    """Median per-step ms of CB decode and of HF ``generate``'s decode at one uniform shape.

    ``cb_step_ms`` still contains the admission's KV copy spread over the steps; the fit removes it with
    the fitted ``kv_ms`` so that it is not counted twice (it belongs to the prefill's KV term).
    """

    rows: int
    width: int
    steps: int  # decode forwards per call (max_new_tokens - 1)
    cb_step_ms: float
    ordinary_step_ms: float
    cb_includes_copy: bool = True  # False: per-step medians of the steps alone (no admission copy in them)

    def mean_context(self) -> float:
        # Ordinary step t (1..steps) holds width + t positions (see costs.ordinary_cost_ms).
        return self.width + (self.steps + 1) / 2


@dataclass(frozen=True)
class FitRow:
    kind: str  # "prefill", "prefill+kv", "packed" (forward + copy) or "decode"
    rows: int
    width: int
    measured_ms: float
    predicted_ms: float
    holdout: bool
    scale_ms: float  # what relative error is relative to (the measurement; for decode, the HF step)

    @property
    def relative_error(self) -> float:
        return (self.predicted_ms - self.measured_ms) / max(self.scale_ms, _MIN_SCALE_MS)


@dataclass
class FitReport:
    costs: CostCoefficients
    rows: list[FitRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def median_error(self, holdout: bool, kinds: Sequence[str] = ("prefill", "prefill+kv")) -> float | None:
        """Median |relative error| over the fitted (or held-out) rows of the given kinds."""
        errors = [abs(r.relative_error) for r in self.rows if r.holdout == holdout and r.kind in kinds]
        return statistics.median(errors) if errors else None

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "problems": list(self.problems),
            "median_fit_error": self.median_error(holdout=False),
            "median_holdout_error": self.median_error(holdout=True),
            "median_decode_error": self.median_error(holdout=False, kinds=("decode",)),
            "rows": [
                {"kind": r.kind, "rows": r.rows, "width": r.width, "measured_ms": r.measured_ms,
                 "predicted_ms": r.predicted_ms, "relative_error": r.relative_error, "holdout": r.holdout}
                for r in self.rows
            ],
        }


def prefill_features(rows: int, width: int, kv_copy: bool, geometry: ModelGeometry) -> np.ndarray:
    """One design-matrix row in PREFILL_TERMS order: [1, B·L, GFLOPs, MiB or 0]."""
    kv = kv_mib(rows, width, geometry) if kv_copy else 0.0
    return np.array([1.0, rows * width, attention_gflops(rows, width, geometry), kv])


def decode_features(point: DecodePoint, geometry: ModelGeometry) -> np.ndarray:
    """One design-matrix row in DECODE_TERMS order: [+1, −1, −MiB(B, mean context)]."""
    return np.array([1.0, -1.0, -kv_mib(point.rows, point.mean_context(), geometry)])


def predict_prefill_ms(point: PrefillPoint, geometry: ModelGeometry, costs: CostCoefficients) -> float:
    return prefill_cost_ms(point.rows, point.width, geometry, costs, include_kv_copy=point.kv_copy)


def weighted_nnls(design: np.ndarray, measured: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """argmin_{x >= 0} Σ ((design·x − measured) / scale)²: relative least squares, never negative."""
    scale = np.maximum(scale, _MIN_SCALE_MS)
    solution, _ = nnls(design / scale[:, None], measured / scale)
    return np.maximum(solution, 0.0)  # nnls returns exact zeros, never negatives; keep the contract explicit


def numerical_rank(design: np.ndarray) -> int:
    """Rank after scaling each column to unit norm, so units (ms vs GFLOPs) do not matter."""
    norms = np.linalg.norm(design, axis=0)
    scaled = design[:, norms > 0] / norms[norms > 0]
    if scaled.size == 0:
        return 0
    singular = np.linalg.svd(scaled, compute_uv=False)
    return int(np.sum(singular > _RANK_TOLERANCE * singular[0]))


def fit_costs(
    prefill: Sequence[PrefillPoint],
    decode: Sequence[DecodePoint],
    geometry: ModelGeometry,
    max_median_error: float = MAX_MEDIAN_ERROR,
    packed: Sequence[PackedPoint] = (),
) -> FitReport:
    """Fit all coefficients; the report lists per-shape errors and any reason to refuse the fit
    (``max_median_error``: the largest acceptable median relative error of the fitted prefill shapes).
    ``packed_prompt_ms`` is fitted from the `packed` forwards after the rest (see `packed_fit`); without
    them it keeps its default."""
    problems: list[str] = []
    fitted = [p for p in prefill if not p.holdout]
    prefill_values = _fit_prefill(fitted, geometry, problems)
    prefill_values = _with_extension_if_better(prefill, prefill_values, geometry)
    kv_ms = prefill_values["kv_ms"]
    decode_values = _fit_decode(decode, geometry, kv_ms, problems)
    shared_values = _fit_shared(decode, geometry, decode_values["decode_ms"], kv_ms)
    costs = CostCoefficients(**prefill_values, **decode_values, **shared_values)
    costs = replace(costs, packed_prompt_ms=fit_packed_prompt_ms(packed, geometry, costs))
    packed_rows = [FitRow("packed", p.rows, p.width, p.measured_ms, predict_packed_ms(p, geometry, costs), False,
                          p.measured_ms) for p in packed]
    report = FitReport(costs, _prefill_rows(prefill, geometry, costs) + packed_rows + _decode_rows(decode, geometry, costs))
    median = report.median_error(holdout=False)
    if median is not None and median > max_median_error:
        problems.append(
            f"median relative error of the fitted prefill shapes is {median:.0%} (> {max_median_error:.0%}): "
            "the measurements are too noisy or the cost model does not describe this device; re-measure "
            "with more --repeats on a quiet machine"
        )
    report.problems = problems
    return report


def _fit_prefill(points: Sequence[PrefillPoint], geometry: ModelGeometry, problems: list[str]) -> dict:
    if len(points) < len(PREFILL_TERMS):
        problems.append(
            f"only {len(points)} prefill measurements for {len(PREFILL_TERMS)} coefficients "
            f"({', '.join(PREFILL_TERMS)}): measure more shapes"
        )
        return dict.fromkeys(PREFILL_TERMS, 0.0)
    design = np.stack([prefill_features(p.rows, p.width, p.kv_copy, geometry) for p in points])
    measured = np.array([p.measured_ms for p in points])
    rank = numerical_rank(design)
    if rank < len(PREFILL_TERMS):
        problems.append(
            f"the prefill design matrix has rank {rank} < {len(PREFILL_TERMS)}: the shapes cannot separate "
            "fixed, per-token, attention and KV-copy costs; use several batch sizes and widths, and measure "
            "both the plain forward and the forward + cache copy"
        )
    values = weighted_nnls(design, measured, measured)
    if not np.any(values > 0):
        problems.append("all prefill coefficients fitted to zero: the measurements carry no signal")
    return dict(zip(PREFILL_TERMS, values.tolist(), strict=True))


def _with_extension_if_better(points: Sequence[PrefillPoint], reference: dict, geometry: ModelGeometry) -> dict:
    """The reference's prefill terms, or those plus `EXTENSION_TERM` when that fit's median error on the
    *held-out* shapes is at least 10% lower (no held-out shapes: the reference model)."""
    fitted, held_out = [p for p in points if not p.holdout], [p for p in points if p.holdout]
    reference = {**reference, EXTENSION_TERM: 0.0}
    if not held_out or len(fitted) <= len(PREFILL_TERMS) + 1:
        return reference
    design = np.stack([np.append(prefill_features(p.rows, p.width, p.kv_copy, geometry), (p.rows * p.width / 1e3) ** 2)
                       for p in fitted])
    measured = np.array([p.measured_ms for p in fitted])
    values = weighted_nnls(design, measured, measured)
    extended = dict(zip((*PREFILL_TERMS, EXTENSION_TERM), values.tolist(), strict=True))

    def held_out_error(values: dict) -> float:
        costs = CostCoefficients(**values)
        return statistics.median(abs(predict_prefill_ms(p, geometry, costs) / p.measured_ms - 1) for p in held_out)

    return extended if held_out_error(extended) < 0.9 * held_out_error(reference) else reference


def _fit_decode(
    points: Sequence[DecodePoint], geometry: ModelGeometry, kv_ms: float, problems: list[str]
) -> dict:
    if len(points) < 2:
        problems.append(f"only {len(points)} decode measurements: measure at least two shapes")
        return dict.fromkeys(DECODE_TERMS, 0.0)
    design = np.stack([decode_features(p, geometry) for p in points])
    if numerical_rank(design[:, [0, 2]]) < 2:
        problems.append(
            "the decode measurements all hold the same KV cache size: use shapes with different batch "
            "sizes or prompt lengths so the per-MiB cache re-copy term is identified"
        )
    differences = np.array([_step_difference_ms(p, geometry, kv_ms) for p in points])
    scale = np.array([p.ordinary_step_ms for p in points])
    values = weighted_nnls(design, differences, scale)
    return dict(zip(DECODE_TERMS, values.tolist(), strict=True))


def _fit_shared(points: Sequence[DecodePoint], geometry: ModelGeometry, decode_ms: float, kv_ms: float) -> dict:
    """The decode work both routes share (`SHARED_TERMS`), from the CB steps: cb − decode_ms ≈ step_ms +
    step_row_ms·B + step_kv_ms·MiB(B, context). Only the profile's predictions use it; 0 when unidentified."""
    if len(points) < len(SHARED_TERMS):
        return dict.fromkeys(SHARED_TERMS, 0.0)
    design = np.array([[1.0, p.rows, kv_mib(p.rows, p.mean_context(), geometry)] for p in points])
    copy = [kv_ms * kv_mib(p.rows, p.width, geometry) / max(p.steps, 1) if p.cb_includes_copy else 0.0 for p in points]
    shared = np.array([p.cb_step_ms - c - decode_ms for p, c in zip(points, copy, strict=True)])
    values = weighted_nnls(design, np.maximum(shared, 0.0), np.array([p.cb_step_ms for p in points]))
    return dict(zip(SHARED_TERMS, values.tolist(), strict=True))


def _step_difference_ms(point: DecodePoint, geometry: ModelGeometry, kv_ms: float) -> float:
    """Measured CB − ordinary ms per step, without the admission's KV copy (already in the prefill)."""
    copy_ms = kv_ms * kv_mib(point.rows, point.width, geometry) if point.cb_includes_copy else 0.0
    return point.cb_step_ms - copy_ms / max(point.steps, 1) - point.ordinary_step_ms


def _prefill_rows(
    points: Sequence[PrefillPoint], geometry: ModelGeometry, costs: CostCoefficients
) -> list[FitRow]:
    return [
        FitRow("prefill+kv" if p.kv_copy else "prefill", p.rows, p.width, p.measured_ms,
               predict_prefill_ms(p, geometry, costs), p.holdout, p.measured_ms)
        for p in points
    ]


def _decode_rows(
    points: Sequence[DecodePoint], geometry: ModelGeometry, costs: CostCoefficients
) -> list[FitRow]:
    coefficients = np.array([getattr(costs, name) for name in DECODE_TERMS])
    return [
        FitRow("decode", p.rows, p.width, _step_difference_ms(p, geometry, costs.kv_ms),
               float(decode_features(p, geometry) @ coefficients), False, p.ordinary_step_ms)
        for p in points
    ]
