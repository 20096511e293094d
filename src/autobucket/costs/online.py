"""Online learning of `CostCoefficients` from the timings every `generate` call already measures.

Each call's `Profile.timings` (prefill forwards, KV copies, decode steps of either route, with their
shapes) join a window of recent observations; the coefficients are refitted per *block* of terms that
the observations touch:

* ``prefill``: ``fixed_ms``, ``token_ms``, ``attention_ms`` from prefill forwards, and the super-linear
  ``forward_sq_ms`` only when it lowers the error on held-out observations (`select_and_fit`);
* ``kv``: ``kv_ms`` from KV copies (timed on their own, so not collinear with ``token_ms``);
* ``decode``: the shared step terms and the route-specific ``decode_ms``, ``ordinary_decode_ms``,
  ``ordinary_decode_kv_ms`` from decode steps (CB − ordinary is what the route choice uses).

The fit is *robust* and *anchored*:

* relative least squares, non-negative (scipy's NNLS), with a weak ridge pulling every coefficient towards
  the prior (worth `PRIOR_WEIGHT` of one observation): a direction the data does not identify (for
  example ``ordinary_decode_ms`` before any ordinary call) stays at the prior instead of drifting;
* outliers (a call slowed by another job) are rejected by their log-ratio residual, beyond
  `OUTLIER_MADS` median absolute deviations, and the fit is repeated without them;
* an update is *accepted* only when it predicts the window's observations no worse (median relative
  error) than the coefficients in use: one noisy call never swings the route decision.

Decode steps arrive by the hundred per call: they are first summarised per (kind, rows) as a median.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import nnls

from autobucket.costs.coefficients import (
    CB_STEP,
    KV_COPY,
    ORDINARY_STEP,
    PREFILL_FORWARD,
    CostCoefficients,
    ModelGeometry,
    timing_features,
    timing_ms,
)
from autobucket.profile import Timing

BLOCKS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # block -> (timing kinds, coefficient names)
    "prefill": ((PREFILL_FORWARD,), ("fixed_ms", "token_ms", "attention_ms", "forward_sq_ms")),
    "kv": ((KV_COPY,), ("kv_ms",)),
    "decode": ((CB_STEP, ORDINARY_STEP), ("step_ms", "step_row_ms", "step_kv_ms", "decode_ms",
                                          "ordinary_decode_ms", "ordinary_decode_kv_ms")),
}  # fmt: skip
OPTIONAL_TERMS = ("forward_sq_ms",)  # fitted only when they lower the split-half held-out error ...
OPTIONAL_GAIN = 0.75  # ... to below this fraction (a busy machine's contention mimics super-linearity)
OPTIONAL_MIN_OBSERVATIONS = 32
WINDOW = 96  # observations kept per block (older ones are forgotten)
PRIOR_WEIGHT = 0.1  # the prior counts like this fraction of one observation, per coefficient
OUTLIER_MADS = 4.0  # residuals beyond this many (scaled) MADs are rejected ...
MIN_OUTLIER_LOG = 0.25  # ... but never closer than this log-ratio (~28%) to the fit
_MIN_MS = 1e-3  # relative errors are taken relative to at least this


@dataclass(frozen=True)
class Update:
    """What one `observe` did per block: accepted (refit in use) or kept, and the median errors."""

    accepted: dict[str, bool]
    error_before: dict[str, float]
    error_after: dict[str, float]


class OnlineCosts:
    """The coefficients in use and the observation window they are fitted to."""

    def __init__(
        self,
        prior: CostCoefficients,
        geometry: ModelGeometry,
        observations: Iterable[Timing] = (),
        robust: bool = True,
    ) -> None:
        self.prior, self.geometry, self.robust = prior, geometry, robust
        self.costs = prior
        self.window: dict[str, list[Timing]] = {block: [] for block in BLOCKS}
        self.updates = 0  # accepted refits
        self._add(list(observations))

    def observations(self) -> list[Timing]:
        return [timing for block in BLOCKS for timing in self.window[block]]

    def observe(self, timings: Sequence[Timing]) -> Update:
        """Add one call's timings and refit; keep the current coefficients where the refit is worse."""
        self.add(timings)
        return self.refit()

    def add(self, timings: Sequence[Timing]) -> None:
        """Add one call's timings to the window without refitting (`refit` fits them later)."""
        self._add(summarize(timings))

    def refit(self) -> Update:
        """Refit every block to the window; keep the current coefficients where the refit is worse."""
        accepted, before, after = {}, {}, {}
        values = self.costs.to_dict()
        for block, (_, names) in BLOCKS.items():
            window = self.window[block]
            if not window:
                continue
            candidate = select_and_fit(window, names, self.geometry, self.prior, self.robust)
            trial = replace(self.costs, **candidate)
            before[block] = median_relative_error(window, self.geometry, self.costs)
            after[block] = median_relative_error(window, self.geometry, trial)
            accepted[block] = not self.robust or after[block] <= before[block]
            if accepted[block]:
                values.update(candidate)
        self.costs = CostCoefficients(**values)
        self.updates += any(accepted.values())
        return Update(accepted, before, after)

    def _add(self, timings: Sequence[Timing]) -> None:
        for block, (kinds, _) in BLOCKS.items():
            fresh = [t for t in timings if t.kind in kinds and t.ms > 0]
            self.window[block] = (self.window[block] + fresh)[-WINDOW:]


def summarize(timings: Sequence[Timing]) -> list[Timing]:
    """Prefill forwards and KV copies as they are; decode steps as one median per (kind, rows)."""
    kept = [t for t in timings if t.kind in (PREFILL_FORWARD, KV_COPY)]
    steps: dict[tuple[str, int], list[Timing]] = {}
    for timing in timings:
        if timing.kind in (CB_STEP, ORDINARY_STEP):
            steps.setdefault((timing.kind, timing.rows), []).append(timing)
    for (kind, rows), group in steps.items():
        width = round(statistics.fmean(t.width for t in group))
        kept.append(Timing(kind, rows, width, statistics.median(t.ms for t in group)))
    return kept


def predicted_ms(timings: Sequence[Timing], geometry: ModelGeometry, costs: CostCoefficients) -> float:
    return sum(timing_ms(t.kind, t.rows, t.width, geometry, costs) for t in timings)


def median_relative_error(timings: Sequence[Timing], geometry: ModelGeometry, costs: CostCoefficients) -> float:
    errors = [abs(timing_ms(t.kind, t.rows, t.width, geometry, costs) - t.ms) / max(t.ms, _MIN_MS)
              for t in timings]
    return statistics.median(errors) if errors else 0.0


def select_and_fit(
    timings: Sequence[Timing], names: tuple[str, ...], geometry: ModelGeometry, prior: CostCoefficients, robust: bool
) -> dict[str, float]:
    """`fit_block` of the block's terms; an `OPTIONAL_TERMS` term is kept (else set to 0) only when fitting
    it lowers the error on held-out observations by 25%: fit on every other observation, test on the rest,
    both ways round."""
    optional = [name for name in names if name in OPTIONAL_TERMS]
    base = tuple(name for name in names if name not in optional)
    without = {**fit_block(timings, base, geometry, prior, robust), **dict.fromkeys(optional, 0.0)}
    if not optional or len(timings) < OPTIONAL_MIN_OBSERVATIONS:
        return without
    halves = (timings[0::2], timings[1::2])

    def held_out_error(terms: tuple[str, ...]) -> float:
        errors = []
        for train, test in (halves, halves[::-1]):
            values = {**dict.fromkeys(optional, 0.0), **fit_block(train, terms, geometry, prior, robust)}
            errors.append(median_relative_error(test, geometry, replace(prior, **values)))
        return statistics.fmean(errors)

    if held_out_error(names) < OPTIONAL_GAIN * held_out_error(base):
        return fit_block(timings, names, geometry, prior, robust)
    return without


def fit_block(
    timings: Sequence[Timing],
    names: tuple[str, ...],
    geometry: ModelGeometry,
    prior: CostCoefficients,
    robust: bool = True,
) -> dict[str, float]:
    """Non-negative relative least squares of `names`, anchored to `prior`, outliers rejected (robust)."""
    design = np.array([[timing_features(t.kind, t.rows, t.width, geometry).get(n, 0.0) for n in names]
                       for t in timings])
    measured = np.array([max(t.ms, _MIN_MS) for t in timings])
    anchor = np.array([getattr(prior, name) for name in names])
    inliers = np.ones(len(timings), dtype=bool)
    for _ in range(5 if robust else 1):
        solution = anchored_nnls(design[inliers], measured[inliers], anchor)
        if not robust:
            break
        keep = _inliers(design @ solution, measured)
        if keep.sum() < max(len(names), 2) or np.array_equal(keep, inliers):
            break
        inliers = keep
    return dict(zip(names, solution.tolist(), strict=True))


def anchored_nnls(design: np.ndarray, measured: np.ndarray, anchor: np.ndarray) -> np.ndarray:
    """argmin_{x >= 0} Σ ((design·x − measured)/measured)² + PRIOR_WEIGHT · Σ_j (s_j (x_j − anchor_j))²,

    where s_j is the root-mean-square of column j of the relative design: the anchor weighs like
    PRIOR_WEIGHT of one observation whatever the units. Columns no observation touches keep the anchor."""
    relative = design / measured[:, None]
    scale = np.sqrt(np.mean(relative**2, axis=0))
    touched = scale > 0
    solution = anchor.astype(float).copy()
    if not touched.any():
        return solution
    ridge = np.sqrt(PRIOR_WEIGHT) * np.diag(scale[touched])
    left = np.vstack([relative[:, touched], ridge])
    right = np.concatenate([np.ones(len(measured)) - relative[:, ~touched] @ anchor[~touched],
                            ridge @ anchor[touched]])
    solution[touched], _ = nnls(left, right)
    return solution


def _inliers(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Observations whose log-ratio residual is within OUTLIER_MADS scaled MADs of the median one."""
    residual = np.log(np.maximum(predicted, _MIN_MS) / measured)
    centre = np.median(residual)
    spread = 1.4826 * np.median(np.abs(residual - centre))
    return np.abs(residual - centre) <= max(OUTLIER_MADS * spread, MIN_OUTLIER_LOG)
