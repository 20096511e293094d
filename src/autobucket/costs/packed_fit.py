"""Fitting `packed_prompt_ms`, the per-prompt cost of a packed prefill forward (pure Python).

Calibration times packed forwards (+ their KV copy) of `rows` prompts of `width` tokens in one row.
The planner predicts such a forward as `forms.packed_cost_ms`: the padded coefficients on its T tokens
and attention pairs, plus ``packed_prompt_ms·rows``. With the padded coefficients already fitted, the
residual ``measured − packed_cost_ms(packed_prompt_ms = 0)`` is ``packed_prompt_ms·rows``: a one-column
non-negative least squares, weighted by 1/measured as the prefill fit is (relative error), whose solution
is closed-form: ``max(0, Σ w²·n·r / Σ w²·n²)``. Carrying the padded model's error into the residual is
deliberate: the term makes the planner's packed estimates match what packed forwards measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from autobucket.costs.coefficients import CostCoefficients, ModelGeometry
from autobucket.planning.forms import DENSE, SEGMENTS, FormCosts, packed_cost_ms

_MIN_SCALE_MS = 1e-6  # as in fit.py: a 0 ms reading keeps a finite weight


@dataclass(frozen=True)
class PackedPoint:
    """Median ms of one packed forward + KV copy of `rows` prompts of `width` tokens each."""

    rows: int
    width: int
    attention: str  # SEGMENTS or DENSE: how the forward kept its prompts apart (its attention work)
    measured_ms: float

    def __post_init__(self) -> None:
        if self.attention not in (SEGMENTS, DENSE):
            raise ValueError(f"attention={self.attention!r} is invalid; pass {SEGMENTS!r} or {DENSE!r}")


def predict_packed_ms(point: PackedPoint, geometry: ModelGeometry, costs: CostCoefficients) -> float:
    """The planner's estimate of the point's forward + copy (`forms.packed_cost_ms`)."""
    return packed_cost_ms([point.width] * point.rows, geometry, costs, FormCosts.of(costs), point.attention)


def fit_packed_prompt_ms(points: Sequence[PackedPoint], geometry: ModelGeometry, costs: CostCoefficients) -> float:
    """`packed_prompt_ms` >= 0 that best explains `points` given the other coefficients; without points,
    `costs.packed_prompt_ms` unchanged (the default, for a calibration that measured no packed forward)."""
    if not points:
        return costs.packed_prompt_ms
    without = replace(costs, packed_prompt_ms=0.0)
    numerator = denominator = 0.0
    for point in points:
        weight = 1.0 / max(point.measured_ms, _MIN_SCALE_MS) ** 2
        residual = point.measured_ms - predict_packed_ms(point, geometry, without)
        numerator += weight * point.rows * residual
        denominator += weight * point.rows * point.rows
    return max(numerator / denominator, 0.0)
