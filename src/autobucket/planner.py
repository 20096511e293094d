"""Prefill bucket planning and route choice (pure Python, never imports torch).

**Why contiguous buckets of the length-sorted order suffice.** A bucket's cost depends only on its row count
B and its width W (its longest prompt), and is non-decreasing in W because every coefficient is >= 0. Take
any partition, order its buckets by width W_1 >= W_2 >= ..., and refill them in that order with the B_1
longest prompts, then the next B_2, and so on. Old buckets k.. hold every prompt not in buckets 1..k-1, all
of length <= W_k, so the first prompt of new bucket k is <= W_k: no bucket gets wider, none changes its row
count, and a bucket within the token limit (B·W <= max_tokens) stays within it. So some optimal plan is a
sequence of contiguous runs of the length-descending order.

**Why the DP is linear-time.** With prompts sorted descending, a bucket of sorted positions i..j costs
``fixed + s_i·(j - i + 1)``, where ``s_i`` (ms per row at width L_i) is non-increasing in i. Then
``best(x) = min_i best(i) + fixed + s_i·(x - i)`` for prefix length x, a minimum over lines in x. Writing
``f_i(x)`` for candidate i's total, ``f_c(x) - f_b(x)`` is non-increasing in x for b < c (slope
``s_c - s_b <= 0``), and a token limit only makes the older candidate b infeasible (+inf) from some x on, so
once a later start beats an earlier one it keeps beating it. A deque of candidates, each tagged with the
first x from which it is best, therefore answers every prefix; the takeover point of a new candidate over
the deque's back is a closed-form root of the linear difference, capped by when the back hits the token
limit. Each candidate is pushed and popped at most once: O(n) after an O(n log n) sort, O(n) memory.

**Ties.** Plans compare as (cost, bucket count) lexicographically, so among equal-cost plans the fewest
buckets win; adding (bucket cost, 1) preserves that order, so the DP stays exact. Float rounding makes
mathematically equal costs differ in the last bits (equal prompts with fixed_ms = 0 would scatter into
singletons), so two candidates whose costs differ by less than 1e-12 of their magnitude count as tied:
fewer buckets wins; on equal counts the cheaper wins (on an exact tie, the later start, so earlier
buckets fill up first: 129 equal prompts under a 128-prompt limit split 128 + 1). The cost is
thus optimal to ~1e-12 relative per decision, far below the model's accuracy; with exactly representable
costs of moderate size (e.g. small integers) the plan is the exact lexicographic optimum.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from autobucket.costs import (
    CostCoefficients,
    ModelGeometry,
    continuous_decode_cost_ms,
    ordinary_cost_ms,
    prefill_cost_ms,
    prefill_row_terms_ms,
)

DEFAULT_MAX_TOKENS = 65536
# Plans whose costs differ by less than this fraction of their magnitude count as tied (float rounding).
_TIE_RELATIVE = 1e-12
ROUTE_ORDINARY = "ordinary"
ROUTE_BUCKETED = "bucketed"


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """Prefill buckets of original prompt indices, longest prompts first, each padded to its width."""

    buckets: tuple[tuple[int, ...], ...]
    widths: tuple[int, ...]  # padded width (longest prompt, tokens) of each bucket
    cost_ms: float  # sum of the buckets' estimated prefill ms, KV copy included

    def __post_init__(self) -> None:
        if len(self.buckets) != len(self.widths):
            raise ValueError(
                f"{len(self.buckets)} buckets but {len(self.widths)} widths; pass one width each"
            )
        if any(not bucket for bucket in self.buckets):
            raise ValueError("a prefill bucket is empty; every bucket needs at least one prompt index")
        if not math.isfinite(self.cost_ms) or self.cost_ms < 0:
            raise ValueError(f"cost_ms={self.cost_ms!r} is invalid; pass a finite float >= 0")

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(len(bucket) for bucket in self.buckets)

    @property
    def padded_tokens(self) -> tuple[int, ...]:
        return tuple(len(bucket) * width for bucket, width in zip(self.buckets, self.widths, strict=True))


def plan_prefill(
    lengths: Sequence[int],
    geometry: ModelGeometry,
    costs: CostCoefficients,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    samples_per_prompt: int = 1,
) -> PrefillPlan:
    """Cheapest split of the prompts into prefill buckets under the cost model (exact DP).

    A bucket holds a contiguous run of the length-descending (stable) order and is feasible when
    rows × width <= ``max_tokens`` (None: no limit). Empty input gives an empty plan of 0 ms. Each
    prompt is prefilled once and its KV copied into ``samples_per_prompt`` cache rows.
    """
    _check_count("samples_per_prompt", samples_per_prompt)
    costs = shared_prefill_costs(costs, samples_per_prompt)
    return _plan_checked(_checked_lengths(lengths, max_tokens), geometry, costs, max_tokens)


def shared_prefill_costs(costs: CostCoefficients, samples_per_prompt: int) -> CostCoefficients:
    """Coefficients for prefilling a prompt once and copying its KV into k sample rows: the forward is
    paid once per prompt, the KV copy k times, so only ``kv_ms`` scales."""
    if samples_per_prompt == 1:
        return costs
    return replace(costs, kv_ms=costs.kv_ms * samples_per_prompt)


def _plan_checked(
    lengths: list[int], geometry: ModelGeometry, costs: CostCoefficients, max_tokens: int | None
) -> PrefillPlan:
    if not lengths:
        return PrefillPlan((), (), 0.0)
    # reverse=True keeps equal lengths in ascending index order (Python's sort is stable).
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    sorted_lengths = [lengths[index] for index in order]
    starts = _optimal_bucket_starts(
        sorted_lengths, costs.fixed_ms, *prefill_row_terms_ms(geometry, costs), max_tokens
    )
    bounds = list(zip(starts, [*starts[1:], len(order)], strict=True))
    buckets = tuple(tuple(order[start:end]) for start, end in bounds)
    widths = tuple(sorted_lengths[start] for start, _ in bounds)
    cost_ms = sum(prefill_cost_ms(len(b), w, geometry, costs) for b, w in zip(buckets, widths, strict=True))
    return PrefillPlan(buckets, widths, cost_ms)


def _checked_max_tokens(max_tokens: Any) -> None:
    if max_tokens is None:
        return
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} is invalid; pass a positive int, or None for no limit")


def _checked_lengths(lengths: Sequence[int], max_tokens: int | None) -> list[int]:
    """Validated prompt lengths as Python ints; names the first bad prompt index."""
    _checked_max_tokens(max_tokens)
    values = list(lengths)
    # Fast path for the common case: plain positive ints.
    if not all(type(value) is int for value in values) or (values and min(values) < 1):
        values = [_checked_length(index, value) for index, value in enumerate(values)]
    if max_tokens is not None and values and max(values) > max_tokens:
        index = max(range(len(values)), key=values.__getitem__)
        raise ValueError(
            f"prompt {index} has {values[index]} tokens, over max_tokens={max_tokens} per prefill forward; "
            "raise max_tokens (or pass None for no limit) or shorten the prompt (no chunked prefill)"
        )
    return values


def _checked_length(index: int, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"prompt {index} has length {value!r}; lengths must be positive ints (token counts)")
    return int(value)


def _optimal_bucket_starts(
    lengths: list[int],
    fixed_ms: float,
    linear_ms: float,
    quadratic_ms: float,
    max_tokens: int | None,
) -> list[int]:
    """Start positions of the optimal buckets of length-descending ``lengths`` (see module docstring)."""
    n = len(lengths)
    slopes = [linear_ms * width + quadratic_ms * width * width for width in lengths]  # ms per row
    # last_end[k]: the largest prefix length a bucket starting at k may reach; strictly increasing in k.
    last_end = [n] * n if max_tokens is None else [k + max_tokens // w for k, w in enumerate(lengths)]
    best_ms = [0.0] * (n + 1)  # best_ms[x]: cheapest plan of the first x prompts
    counts = [0] * (n + 1)  # its bucket count (tie-break)
    parent = [0] * (n + 1)  # start of its last bucket
    candidates: list[int] = []  # deque [head:]: candidate bucket starts, in increasing order
    since: list[int] = []  # since[q]: first prefix length for which candidates[q] is best
    head = 0
    for new in range(n):
        while len(candidates) > head:
            back = candidates[-1]
            first_x = max(since[-1], new + 1)
            takeover = _takeover_x(new, back, first_x, last_end[back] + 1, slopes, best_ms, counts)
            if takeover > first_x:
                if takeover <= n:
                    candidates.append(new)
                    since.append(takeover)
                break
            candidates.pop()  # the new start beats the back over the back's whole range
            since.pop()
        else:
            candidates.append(new)
            since.append(new + 1)
        x = new + 1
        while head + 1 < len(candidates) and since[head + 1] <= x:
            head += 1
        start = candidates[head]
        assert x <= last_end[start], "the DP deque must always offer a bucket within the token limit"
        best_ms[x] = best_ms[start] + fixed_ms + slopes[start] * (x - start)
        counts[x] = counts[start] + 1
        parent[x] = start
    return _unwind(parent, n)


def _takeover_x(
    new: int,
    old: int,
    first_x: int,
    old_infeasible_x: int,
    slopes: list[float],
    best_ms: list[float],
    counts: list[int],
) -> int:
    """First prefix length x in [first_x, old_infeasible_x] where starting the last bucket at ``new``
    beats starting it at ``old`` (< new): lower cost, or a (near-)tie with fewer buckets, or an exact
    tie with as many (see the module docstring on ties)."""
    new_intercept = best_ms[new] - slopes[new] * new
    old_intercept = best_ms[old] - slopes[old] * old
    # f_new(x) - f_old(x) = gap - drop·x, drop >= 0 because lengths are sorted descending.
    gap = new_intercept - old_intercept
    drop = slopes[old] - slopes[new]
    tie_ms = _TIE_RELATIVE * (best_ms[new] + best_ms[old] + slopes[new] * new + slopes[old] * old)
    if counts[new] < counts[old]:
        gap -= tie_ms  # a near-tie counts as a win for the plan with fewer buckets ...
    elif counts[new] > counts[old]:
        gap += tie_ms  # ... and as a loss for the one with more
    # An exact tie with more buckets loses; otherwise the later start (fuller earlier buckets) wins it.
    wins_at_root = counts[new] <= counts[old]
    if drop <= 0:
        return first_x if gap < 0 or (gap == 0 and wins_at_root) else old_infeasible_x
    root = gap / drop  # new wins for x > root (x >= root if wins_at_root)
    if root < first_x:
        return first_x
    if root >= old_infeasible_x:
        return old_infeasible_x
    return math.ceil(root) if wins_at_root else math.floor(root) + 1


def _unwind(parent: list[int], n: int) -> list[int]:
    starts = []
    x = n
    while x > 0:
        x = parent[x]
        starts.append(x)
    return starts[::-1]


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
    capacity: int,
    geometry: ModelGeometry,
    costs: CostCoefficients,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    max_positions: int | None = None,
    ordinary_blocked_reason: str | None = None,
    samples_per_prompt: int = 1,
) -> RouteDecision:
    """Choose ordinary padded ``generate`` or bucketed continuous batching for one batch of prompts.

    Ordinary costs one prefill of n rows at the longest width (no KV copy) plus its decode extension;
    bucketed costs the DP plan plus ``decode_ms`` per decode step after the first. Only the routes'
    differences are modelled. Equal estimates choose ordinary (it changes less). With no prompts both
    estimates are 0 ms, so the same rules choose ordinary unless it is blocked.

    With ``samples_per_prompt`` = k, ordinary generation prefills every prompt k times (HF expands rows
    before prefill), while bucketed CB prefills each prompt once and copies its KV into k rows.
    """
    _check_count("samples_per_prompt", samples_per_prompt)
    _check_count("max_new_tokens", max_new_tokens)
    _check_count("capacity", capacity)
    if max_positions is not None:
        _check_count("max_positions", max_positions)
    checked = _checked_lengths(lengths, max_tokens)
    blocked = _ordinary_blockers(
        checked, max_new_tokens, capacity, max_tokens, max_positions, ordinary_blocked_reason, samples_per_prompt
    )
    if not checked:
        return _empty_decision(blocked)
    ordinary_costs, costs = costs, shared_prefill_costs(costs, samples_per_prompt)
    decode_ms = continuous_decode_cost_ms(max_new_tokens, costs)
    lower_bound_ms = _bucketed_lower_bound_ms(checked, geometry, costs) + decode_ms
    ordinary_ms = None
    if not blocked:
        rows = len(checked) * samples_per_prompt
        ordinary_ms = ordinary_cost_ms(rows, max(checked), max_new_tokens, geometry, ordinary_costs)
        if lower_bound_ms >= ordinary_ms:
            reason = (
                f"ordinary estimated cheaper (lower bound of bucketed {lower_bound_ms:.1f} ms >= "
                f"ordinary {ordinary_ms:.1f} ms; DP skipped)"
            )
            return RouteDecision(ROUTE_ORDINARY, (), (), ordinary_ms, None, lower_bound_ms, reason)
    plan = _plan_checked(checked, geometry, costs, max_tokens)
    return _compare_routes(plan, ordinary_ms, plan.cost_ms + decode_ms, lower_bound_ms, blocked)


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid; pass a positive int")


def _ordinary_blockers(
    lengths: list[int],
    max_new_tokens: int,
    capacity: int,
    max_tokens: int | None,
    max_positions: int | None,
    blocked_reason: str | None,
    samples_per_prompt: int = 1,
) -> str:
    """Why ordinary generation cannot run this batch ('' when it can)."""
    rows, longest = len(lengths) * samples_per_prompt, max(lengths, default=0)
    reasons = [] if blocked_reason is None else [blocked_reason or "blocked by the caller"]
    if rows > capacity:
        reasons.append(f"{rows} rows exceed capacity {capacity}")
    if max_tokens is not None and rows * longest > max_tokens:
        reasons.append(
            f"{rows} rows x {longest} tokens = {rows * longest} padded tokens exceed max_tokens {max_tokens}"
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
    plan: PrefillPlan, ordinary_ms: float | None, bucketed_ms: float, lower_bound_ms: float, blocked: str
) -> RouteDecision:
    count = len(plan.buckets)
    if ordinary_ms is None:
        route, reason = ROUTE_BUCKETED, f"ordinary ineligible: {blocked}"
    elif ordinary_ms <= bucketed_ms:
        route = ROUTE_ORDINARY
        reason = (
            f"ordinary estimated cheaper or equal (ordinary {ordinary_ms:.1f} ms <= bucketed "
            f"{bucketed_ms:.1f} ms in {count} buckets)"
        )
    else:
        route = ROUTE_BUCKETED
        reason = (
            f"bucketed estimated cheaper ({count} buckets, {bucketed_ms:.1f} ms < ordinary "
            f"{ordinary_ms:.1f} ms)"
        )
    return RouteDecision(route, plan.buckets, plan.widths, ordinary_ms, bucketed_ms, lower_bound_ms, reason)


def _empty_decision(blocked: str) -> RouteDecision:
    if blocked:
        reason = f"no prompts: nothing to run (both estimates 0 ms); ordinary ineligible: {blocked}"
        return RouteDecision(ROUTE_BUCKETED, (), (), None, 0.0, 0.0, reason)
    reason = "no prompts: nothing to run (both estimates 0 ms; ties choose ordinary)"
    return RouteDecision(ROUTE_ORDINARY, (), (), 0.0, 0.0, 0.0, reason)
