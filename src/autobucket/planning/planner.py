"""Prefill bucket planning: the exact DP over length-sorted contiguous buckets (pure Python, no torch).

**Why contiguous buckets of the length-sorted order suffice.** A bucket's cost depends only on its row count
B and its width W (its longest prompt), and is non-decreasing in W because every coefficient is >= 0. Take
any partition, order its buckets by width W_1 >= W_2 >= ..., and refill them in that order with the B_1
longest prompts, then the next B_2, and so on. Old buckets k.. hold every prompt not in buckets 1..k-1, all
of length <= W_k, so the first prompt of new bucket k is <= W_k: no bucket gets wider, none changes its row
count, and a bucket within the token limit (B·W <= prefill_max_tokens) stays within it. So some optimal plan is a
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

from autobucket.checks import optional_int, require_int
from autobucket.costs.coefficients import (
    CostCoefficients,
    ModelGeometry,
    prefill_cost_ms,
    prefill_row_terms_ms,
)

DEFAULT_PREFILL_MAX_TOKENS = 65536
# Plans whose costs differ by less than this fraction of their magnitude count as tied (float rounding).
_TIE_RELATIVE = 1e-12


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
    prefill_max_tokens: int | None = DEFAULT_PREFILL_MAX_TOKENS,
    samples_per_prompt: int = 1,
) -> PrefillPlan:
    """Cheapest split of the prompts into prefill buckets under the cost model (exact DP).

    A bucket holds a contiguous run of the length-descending (stable) order and is feasible when
    rows × width <= ``prefill_max_tokens`` (None: no limit). Empty input gives an empty plan of 0 ms. Each
    prompt is prefilled once and its KV copied into ``samples_per_prompt`` cache rows.
    """
    require_int("samples_per_prompt", samples_per_prompt)
    costs = shared_prefill_costs(costs, samples_per_prompt)
    return plan_checked_lengths(checked_lengths(lengths, prefill_max_tokens), geometry, costs, prefill_max_tokens)


def shared_prefill_costs(costs: CostCoefficients, samples_per_prompt: int) -> CostCoefficients:
    """Coefficients for prefilling a prompt once and copying its KV into k sample rows: the forward is
    paid once per prompt, the KV copy k times, so only ``kv_ms`` scales."""
    if samples_per_prompt == 1:
        return costs
    return replace(costs, kv_ms=costs.kv_ms * samples_per_prompt)


def plan_checked_lengths(
    lengths: list[int], geometry: ModelGeometry, costs: CostCoefficients, prefill_max_tokens: int | None
) -> PrefillPlan:
    if not lengths:
        return PrefillPlan((), (), 0.0)
    # reverse=True keeps equal lengths in ascending index order (Python's sort is stable).
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    sorted_lengths = [lengths[index] for index in order]
    starts = _optimal_bucket_starts(
        sorted_lengths, costs.fixed_ms, *prefill_row_terms_ms(geometry, costs), prefill_max_tokens
    )
    bounds = list(zip(starts, [*starts[1:], len(order)], strict=True))
    buckets = tuple(tuple(order[start:end]) for start, end in bounds)
    widths = tuple(sorted_lengths[start] for start, _ in bounds)
    cost_ms = sum(prefill_cost_ms(len(b), w, geometry, costs) for b, w in zip(buckets, widths, strict=True))
    return PrefillPlan(buckets, widths, cost_ms)


def checked_lengths(lengths: Sequence[int], prefill_max_tokens: int | None) -> list[int]:
    """Validated prompt lengths as Python ints; names the first bad prompt index."""
    optional_int("prefill_max_tokens", prefill_max_tokens, 1, "or pass None for no limit")
    values = list(lengths)
    # Fast path for the common case: plain positive ints.
    if not all(type(value) is int for value in values) or (values and min(values) < 1):
        values = [_checked_length(index, value) for index, value in enumerate(values)]
    if prefill_max_tokens is not None and values and max(values) > prefill_max_tokens:
        index = max(range(len(values)), key=values.__getitem__)
        raise ValueError(
            f"prompt {index} has {values[index]} tokens, over prefill_max_tokens={prefill_max_tokens} per prefill forward; "
            "raise prefill_max_tokens (or pass None for no limit) or shorten the prompt"
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
    prefill_max_tokens: int | None,
) -> list[int]:
    """Start positions of the optimal buckets of length-descending ``lengths`` (see module docstring)."""
    n = len(lengths)
    best_ms = [0.0] * (n + 1)  # best_ms[x]: cheapest plan of the first x prompts
    counts = [0] * (n + 1)  # its bucket count (tie-break)
    parent = [0] * (n + 1)  # start of its last bucket
    hull = PaddedHull(lengths, fixed_ms, linear_ms, quadratic_ms, prefill_max_tokens, best_ms, counts)
    for new in range(n):
        hull.push(new)
        x = new + 1
        start = hull.best_start(x)
        best_ms[x] = hull.cost_ms(start, x)
        counts[x] = counts[start] + 1
        parent[x] = start
    return unwind_starts(parent, n)


class PaddedHull:
    """The DP's deque of candidate starts for the last padded bucket (see module docstring).

    It reads ``best_ms`` and ``counts`` (shared lists the caller fills): ``push(new)`` needs
    ``best_ms[new]`` and ``counts[new]`` final, ``best_start(x)`` must be asked for x = 1, 2, ... in order."""

    def __init__(
        self,
        lengths: list[int],
        fixed_ms: float,
        linear_ms: float,
        quadratic_ms: float,
        prefill_max_tokens: int | None,
        best_ms: list[float],
        counts: list[int],
    ) -> None:
        n = len(lengths)
        self.n, self.fixed_ms, self.best_ms, self.counts = n, fixed_ms, best_ms, counts
        self.slopes = [linear_ms * width + quadratic_ms * width * width for width in lengths]  # ms per row
        # last_end[k]: the largest prefix length a bucket starting at k may reach; strictly increasing in k.
        self.last_end = (
            [n] * n if prefill_max_tokens is None else [k + prefill_max_tokens // w for k, w in enumerate(lengths)]
        )
        self.candidates: list[int] = []  # deque [head:]: candidate bucket starts, in increasing order
        self.since: list[int] = []  # since[q]: first prefix length for which candidates[q] is best
        self.head = 0

    def push(self, new: int) -> None:
        candidates, since = self.candidates, self.since
        while len(candidates) > self.head:
            back = candidates[-1]
            first_x = max(since[-1], new + 1)
            takeover = _takeover_x(
                new, back, first_x, self.last_end[back] + 1, self.slopes, self.best_ms, self.counts
            )
            if takeover > first_x:
                if takeover <= self.n:
                    candidates.append(new)
                    since.append(takeover)
                return
            candidates.pop()  # the new start beats the back over the back's whole range
            since.pop()
        candidates.append(new)
        since.append(new + 1)

    def best_start(self, x: int) -> int:
        while self.head + 1 < len(self.candidates) and self.since[self.head + 1] <= x:
            self.head += 1
        start = self.candidates[self.head]
        assert x <= self.last_end[start], "the DP deque must always offer a bucket within the token limit"
        return start

    def cost_ms(self, start: int, x: int) -> float:
        """best_ms[start] plus one padded bucket of sorted positions start..x-1."""
        return self.best_ms[start] + self.fixed_ms + self.slopes[start] * (x - start)


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


def unwind_starts(parent: list[int], n: int) -> list[int]:
    """Bucket starts of the plan of all n prompts, from each prefix's last-bucket start."""
    starts = []
    x = n
    while x > 0:
        x = parent[x]
        starts.append(x)
    return starts[::-1]
