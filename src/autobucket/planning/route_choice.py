"""Route choice for one batch: ordinary padded `generate` or bucketed continuous batching (pure
Python, never imports torch). The bucketed estimate comes from `planner.plan_prefill`'s DP; a cheap
lower bound of it skips the DP when ordinary generation provably wins."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from autobucket.checks import require_int
from autobucket.costs.coefficients import (
    CostCoefficients,
    ModelGeometry,
    continuous_decode_cost_ms,
    ordinary_cost_ms,
    planning_token_limit,
    prefill_row_terms_ms,
)
from autobucket.planning.forms import FormCosts, FormPlan, plan_forms
from autobucket.planning.planner import (
    DEFAULT_PREFILL_MAX_TOKENS,
    PrefillPlan,
    checked_lengths,
    plan_checked_lengths,
    shared_prefill_costs,
)

ROUTE_ORDINARY = "ordinary"
ROUTE_BUCKETED = "bucketed"


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Which route to run a batch on, the estimates behind the choice, and why."""

    route: str  # ROUTE_ORDINARY or ROUTE_BUCKETED
    buckets: tuple[tuple[int, ...], ...]  # the DP plan over all prompts; () when the DP was skipped
    widths: tuple[int, ...]
    ordinary_ms: float | None  # None when ordinary generation is ineligible
    bucketed_ms: float | None  # DP prefill + CB decode term; None when the DP was skipped
    bucketed_lower_bound_ms: float  # cheap lower bound of bucketed_ms (up to float rounding)
    reason: str
    forms: tuple[str, ...] = ()  # each bucket's prefill form (planning/forms.py); () means all padded

    def __post_init__(self) -> None:
        if self.route not in (ROUTE_ORDINARY, ROUTE_BUCKETED):
            raise ValueError(
                f"route={self.route!r} is invalid; pass {ROUTE_ORDINARY!r} or {ROUTE_BUCKETED!r}"
            )
        if len(self.buckets) != len(self.widths):
            raise ValueError(
                f"{len(self.buckets)} buckets but {len(self.widths)} widths; pass one width each"
            )
        if self.route == ROUTE_ORDINARY and self.ordinary_ms is None:
            raise ValueError("an ordinary route needs ordinary_ms")
        if self.bucketed_ms is None and (self.route != ROUTE_ORDINARY or self.buckets):
            raise ValueError("bucketed_ms may be None only when the DP was skipped for the ordinary route")


def choose_route(
    lengths: Sequence[int],
    max_new_tokens: int,
    continuous_batch_size: int,
    geometry: ModelGeometry,
    costs: CostCoefficients,
    prefill_max_tokens: int | None = DEFAULT_PREFILL_MAX_TOKENS,
    max_positions: int | None = None,
    ordinary_blocked_reason: str | None = None,
    samples_per_prompt: int = 1,
    forms: FormOptions | None = None,
    shared_saving_ms: float = 0.0,
) -> RouteDecision:
    """Choose ordinary padded ``generate`` or bucketed continuous batching for one batch of prompts.

    Ordinary costs one prefill of n rows at the longest width (no KV copy) plus its decode extension;
    bucketed costs the DP plan plus ``decode_ms`` per decode step after the first. Only the routes'
    differences are modelled. Equal estimates choose ordinary (it changes less). With no prompts both
    estimates are 0 ms, so the same rules choose ordinary unless it is blocked.

    With ``samples_per_prompt`` = k, ordinary generation prefills every prompt k times (HF expands rows
    before prefill), while bucketed CB prefills each prompt once and copies its KV into k rows.

    With ``forms``, the bucketed estimate is `plan_forms`' plan (padded, packed and chunked groups), and
    prompts longer than ``prefill_max_tokens`` are allowed (they are chunked; ordinary is then blocked).

    ``shared_saving_ms``: what prefilling the prompts' shared prefixes once saves the bucketed route
    (`plan_shared_prefixes`); ordinary `generate` cannot share.
    """
    _check_counts(samples_per_prompt, max_new_tokens, continuous_batch_size, max_positions)
    checked = checked_lengths(lengths, prefill_max_tokens if forms is None else None)
    blocked = _ordinary_blockers(
        checked, max_new_tokens, continuous_batch_size, prefill_max_tokens, max_positions, ordinary_blocked_reason,
        samples_per_prompt,
    )
    if not checked:
        return _empty_decision(blocked)
    shared_costs = shared_prefill_costs(costs, samples_per_prompt)
    decode_ms = continuous_decode_cost_ms(max_new_tokens, shared_costs)
    lower_bound_ms = max(0.0, _bucketed_lower_bound_ms(checked, geometry, shared_costs) + decode_ms - shared_saving_ms)
    ordinary_ms = None
    if not blocked:
        rows = len(checked) * samples_per_prompt
        ordinary_ms = ordinary_cost_ms(rows, max(checked), max_new_tokens, geometry, costs)
        if lower_bound_ms >= ordinary_ms:
            reason = (
                f"ordinary estimated cheaper (lower bound of bucketed {lower_bound_ms:.1f} ms >= "
                f"ordinary {ordinary_ms:.1f} ms; DP skipped)"
            )
            return RouteDecision(ROUTE_ORDINARY, (), (), ordinary_ms, None, lower_bound_ms, reason)
    plan = _bucketed_plan(checked, geometry, costs, prefill_max_tokens, samples_per_prompt, forms)
    bucketed_ms = max(0.0, plan.cost_ms + decode_ms - shared_saving_ms)
    decision = _compare_routes(plan, ordinary_ms, bucketed_ms, lower_bound_ms, blocked)
    return decision if forms is None else replace(decision, forms=plan.forms)


def _check_counts(
    samples_per_prompt: int, max_new_tokens: int, continuous_batch_size: int, max_positions: int | None
) -> None:
    require_int("samples_per_prompt", samples_per_prompt)
    require_int("max_new_tokens", max_new_tokens)
    require_int("continuous_batch_size", continuous_batch_size)
    if max_positions is not None:
        require_int("max_positions", max_positions)


def _bucketed_plan(
    lengths: list[int],
    geometry: ModelGeometry,
    costs: CostCoefficients,
    prefill_max_tokens: int | None,
    samples_per_prompt: int,
    forms: FormOptions | None,
) -> PrefillPlan | FormPlan:
    """The bucketed route's prefill plan: padded DP buckets, or `plan_forms`' padded/packed/chunked groups."""
    if forms is not None:
        # plan_forms applies samples_per_prompt itself, so it gets the unshared coefficients.
        return plan_forms(lengths, geometry, costs, prefill_max_tokens, samples_per_prompt, forms.packing, forms.costs)
    shared_costs = shared_prefill_costs(costs, samples_per_prompt)
    limit = planning_token_limit(prefill_max_tokens, shared_costs, max(lengths))
    return plan_checked_lengths(lengths, geometry, shared_costs, limit)


@dataclass(frozen=True, slots=True)
class FormOptions:
    """Plan the bucketed route's prefill in forms: how packed prompts are kept apart (None: no packing),
    and the form costs (None: `FormCosts.of` the route's coefficients, so a calibration's fitted
    `packed_prompt_ms` reaches the planner)."""

    packing: str | None
    costs: FormCosts | None = None


def _ordinary_blockers(
    lengths: list[int],
    max_new_tokens: int,
    continuous_batch_size: int,
    prefill_max_tokens: int | None,
    max_positions: int | None,
    blocked_reason: str | None,
    samples_per_prompt: int = 1,
) -> str:
    """Why ordinary generation cannot run this batch ('' when it can)."""
    rows, longest = len(lengths) * samples_per_prompt, max(lengths, default=0)
    reasons = [] if blocked_reason is None else [blocked_reason or "blocked by the caller"]
    if rows > continuous_batch_size:
        reasons.append(f"{rows} rows exceed continuous_batch_size {continuous_batch_size}")
    if prefill_max_tokens is not None and rows * longest > prefill_max_tokens:
        reasons.append(
            f"{rows} rows x {longest} tokens = {rows * longest} padded tokens exceed prefill_max_tokens {prefill_max_tokens}"
        )
    if max_positions is not None and longest + max_new_tokens > max_positions:
        reasons.append(
            f"longest prompt {longest} + {max_new_tokens} new tokens exceeds max_positions {max_positions}"
        )
    return "; ".join(reasons)


def _bucketed_lower_bound_ms(lengths: list[int], geometry: ModelGeometry, costs: CostCoefficients) -> float:
    """A lower bound of every prefill plan's cost, in O(n) without the DP.

    Proof: a plan of k >= 1 buckets pays k·fixed >= fixed. Each row r sits in a bucket of width W >= L_r and
    pays the per-row cost s(W) = linear·W + quadratic·W², which is non-decreasing in W because both terms
    are >= 0, so s(W) >= s(L_r). Summing: cost >= fixed + sum_r s(L_r). Equality holds for one bucket of
    equal lengths, so uniform batches are decided exactly without the DP.
    """
    linear_ms, quadratic_ms = prefill_row_terms_ms(geometry, costs)
    return costs.fixed_ms + sum(linear_ms * width + quadratic_ms * width * width for width in lengths)


def _compare_routes(
    plan: PrefillPlan | FormPlan, ordinary_ms: float | None, bucketed_ms: float, lower_bound_ms: float, blocked: str
) -> RouteDecision:
    count = len(plan.widths)
    if ordinary_ms is None:
        route, reason = ROUTE_BUCKETED, f"ordinary ineligible: {blocked}"
    elif ordinary_ms <= bucketed_ms:
        route = ROUTE_ORDINARY
        reason = (
            f"ordinary estimated cheaper or equal (ordinary {ordinary_ms:.1f} ms <= bucketed "
            f"{bucketed_ms:.1f} ms in {_buckets(count)})"
        )
    else:
        route = ROUTE_BUCKETED
        reason = (
            f"bucketed estimated cheaper ({_buckets(count)}, {bucketed_ms:.1f} ms < ordinary "
            f"{ordinary_ms:.1f} ms)"
        )
    buckets = plan.groups if isinstance(plan, FormPlan) else plan.buckets
    return RouteDecision(route, buckets, plan.widths, ordinary_ms, bucketed_ms, lower_bound_ms, reason)


def _empty_decision(blocked: str) -> RouteDecision:
    if blocked:
        reason = f"no prompts: nothing to run (both estimates 0 ms); ordinary ineligible: {blocked}"
        return RouteDecision(ROUTE_BUCKETED, (), (), None, 0.0, 0.0, reason)
    reason = "no prompts: nothing to run (both estimates 0 ms; ties choose ordinary)"
    return RouteDecision(ROUTE_ORDINARY, (), (), 0.0, 0.0, 0.0, reason)


def _buckets(count: int) -> str:
    return f"{count} bucket" if count == 1 else f"{count} buckets"
