"""Prefill forms: per admission, padded buckets, packed groups and chunks under one token budget
(pure Python, never imports torch).

Forms and their estimated cost (coefficients from `CostCoefficients`, plus `FormCosts`):

- **padded** (B rows, width W, B·W <= budget): ``fixed + token·B·W + attention·g(B·W²) + kv·B·W``,
  exactly `prefill_cost_ms`.
- **packed** (prompts concatenated in one row, T = ΣL <= budget): ``fixed + token·T + kv·T +
  packed_prompt·n + attention·g(pairs)`` where pairs is the form's real attention work: ΣL² with
  per-segment attention, T² with a dense block-diagonal mask (SDPA computes every masked pair).
- **chunked** (one prompt longer than the budget, ceil(L/C) forwards of <= C tokens): ``k·fixed +
  token·L + attention·g(L²) + kv·L + kv·(prefix re-copies)``; the chunk attention sum telescopes to
  L² (chunk j: c_j·(2·s_j + c_j) pairs in the full-square convention of `attention_gflops`) and the
  model's cache re-concatenates its prefix at every chunk.

**Search space, and why the DP is exact over it.** Prompts longer than the budget are chunked alone
(no other form can hold them). The rest are taken in length-descending order and split into
contiguous runs, each run in its cheapest feasible form; packed runs hold at most
`FormCosts.packed_max_tokens` tokens, dense-packed runs at most `DENSE_MAX_PROMPTS` prompts (their T² cost makes longer runs lose anyway, and it keeps the DP linear).
`best(x) = min over the last run's start i and form of best(i) + cost(i, x)`:
padded runs are the planner's convex-hull deque (`PaddedHull`, O(1) amortised); packed runs cost
``fixed + (B_x - B_i)`` with B the prefix sum of per-prompt terms, so their best start is a sliding-
window minimum of ``best(i) - B_i`` over the starts whose run fits the budget (a monotone deque, O(1)
amortised); dense runs are at most `DENSE_MAX_PROMPTS` candidates. Ties compare (cost, forwards) as
in `planner.py`. Non-contiguous packings (bin packing) are outside this space.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from autobucket.checks import optional_int, require_int
from autobucket.costs.coefficients import (
    CostCoefficients,
    ModelGeometry,
    attention_gflops,
    kv_mib,
    planning_token_limit,
    prefill_cost_ms,
    prefill_row_terms_ms,
)
from autobucket.planning.planner import (
    DEFAULT_PREFILL_MAX_TOKENS,
    PaddedHull,
    checked_lengths,
    shared_prefill_costs,
)

Form: TypeAlias = Literal["padded", "packed", "chunked"]  # how one prefill group is run
PADDED: Final = "padded"
PACKED: Final = "packed"
CHUNKED: Final = "chunked"
SEGMENTS, DENSE = "segments", "dense"  # how a packed row keeps its prompts apart
DENSE_MAX_PROMPTS = 8
_TIE_RELATIVE = 1e-12


@dataclass(frozen=True, slots=True)
class FormCosts:
    """Cost terms of the packed form beyond the padded coefficients (`FormCosts.of(costs)`: the planner's
    default, taking `packed_prompt_ms` from the calibrated coefficients)."""

    # per prompt in a packed forward: its attention call per layer and its KV slice copy (ms);
    # `CostCoefficients.packed_prompt_ms`, which calibration fits
    packed_prompt_ms: float = CostCoefficients().packed_prompt_ms
    # Most tokens in one packed row. On one CPU core a packed forward slows per token as it grows (its
    # activations leave the cache, docs/benchmarks.md); the token costs are linear, so this bound stands
    # in for that growth.
    packed_max_tokens: int | None = 2048

    def __post_init__(self) -> None:
        value = self.packed_prompt_ms
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"packed_prompt_ms={value!r} is invalid; pass a finite float >= 0")
        optional_int("packed_max_tokens", self.packed_max_tokens, 1, "or pass None for no bound but the budget")

    @classmethod
    def of(cls, costs: CostCoefficients) -> FormCosts:
        """The form costs `costs` imply: its fitted `packed_prompt_ms`, the default `packed_max_tokens`."""
        return cls(packed_prompt_ms=costs.packed_prompt_ms)


@dataclass(frozen=True, slots=True)
class FormPlan:
    """Prefill groups of original prompt indices, each with its form; longest prompts first."""

    groups: tuple[tuple[int, ...], ...]
    forms: tuple[Form, ...]
    widths: tuple[int, ...]  # longest prompt of each group (tokens)
    cost_ms: float

    @property
    def forwards(self) -> int:
        return len(self.groups)


def packed_cost_ms(
    lengths: Sequence[int], geometry: ModelGeometry, costs: CostCoefficients, form_costs: FormCosts, attention: str
) -> float:
    """Estimated ms of one packed forward of prompts of `lengths` in one row."""
    total = sum(lengths)
    pairs = total * total if attention == DENSE else sum(n * n for n in lengths)
    return (
        costs.fixed_ms + costs.token_ms * total + costs.kv_ms * kv_mib(1, total, geometry)
        + form_costs.packed_prompt_ms * len(lengths) + costs.attention_ms * attention_gflops(1, 1, geometry) * pairs
        + costs.forward_sq_ms * (total / 1e3) ** 2
    )


def chunked_cost_ms(length: int, chunk_tokens: int, geometry: ModelGeometry, costs: CostCoefficients) -> float:
    """Estimated ms of prefilling one prompt in ceil(length / chunk_tokens) forwards."""
    chunks = -(-length // chunk_tokens)
    recopied = sum(start for start in range(chunk_tokens, length, chunk_tokens))  # prefix columns re-concatenated
    sizes = [min(chunk_tokens, length - start) for start in range(0, length, chunk_tokens)]
    return (
        chunks * costs.fixed_ms + costs.token_ms * length + costs.attention_ms * attention_gflops(1, length, geometry)
        + costs.kv_ms * kv_mib(1, length + recopied, geometry) + costs.forward_sq_ms * sum((c / 1e3) ** 2 for c in sizes)
    )


def plan_forms(
    lengths: Sequence[int],
    geometry: ModelGeometry,
    costs: CostCoefficients,
    prefill_max_tokens: int | None = DEFAULT_PREFILL_MAX_TOKENS,
    samples_per_prompt: int = 1,
    packing: str | None = SEGMENTS,
    form_costs: FormCosts | None = None,
) -> FormPlan:
    """Cheapest prefill of the prompts in padded, packed (when `packing` is SEGMENTS or DENSE) and
    chunked groups, each forward within `prefill_max_tokens` tokens (None: no budget, no chunks).
    `form_costs` None: `FormCosts.of(costs)`."""
    require_int("samples_per_prompt", samples_per_prompt)
    optional_int("prefill_max_tokens", prefill_max_tokens, 1, "or pass None for no limit")
    if packing not in (None, SEGMENTS, DENSE):
        raise ValueError(f"packing={packing!r} is invalid; pass {SEGMENTS!r}, {DENSE!r} or None (no packing)")
    values = checked_lengths(lengths, None)
    costs, form_costs = shared_prefill_costs(costs, samples_per_prompt), form_costs or FormCosts.of(costs)
    order = sorted(range(len(values)), key=values.__getitem__, reverse=True)
    budget = prefill_max_tokens
    long = [i for i in order if budget is not None and values[i] > budget]
    groups = [((i,), CHUNKED) for i in long]
    cost_ms = sum(chunked_cost_ms(values[i], budget, geometry, costs) for i in long)
    rest = order[len(long) :]
    # The DP's terms are linear in a forward's tokens; the super-linear `forward_sq_ms` is respected by
    # capping the tokens of one forward where it makes two halves cheaper (as `plan_prefill`'s callers do).
    limit = planning_token_limit(budget, costs, values[rest[0]]) if rest else budget
    runs = _FormsDP([values[i] for i in rest], geometry, costs, form_costs, limit, packing).runs()
    for start, end, form in runs:
        members = [values[i] for i in rest[start:end]]
        groups.append((tuple(rest[start:end]), form))
        cost_ms += _run_cost_ms(members, form, geometry, costs, form_costs, packing)
    widths = tuple(max(values[i] for i in g) for g, _ in groups)
    return FormPlan(tuple(g for g, _ in groups), tuple(f for _, f in groups), widths, cost_ms)


def _run_cost_ms(members, form, geometry, costs, form_costs, packing) -> float:
    if form == PADDED:
        return prefill_cost_ms(len(members), max(members), geometry, costs)
    return packed_cost_ms(members, geometry, costs, form_costs, packing)


def _better(cost_a: float, count_a: int, cost_b: float, count_b: int) -> bool:
    """Is plan a strictly better than plan b: cheaper, or a near-tie (float rounding) with fewer forwards."""
    if math.isinf(cost_a) or math.isinf(cost_b):
        return cost_a < cost_b
    if abs(cost_a - cost_b) <= _TIE_RELATIVE * (abs(cost_a) + abs(cost_b)):
        return count_a < count_b
    return cost_a < cost_b


class _FormsDP:
    """The DP of the module docstring over length-descending `lengths`, all within the budget."""

    def __init__(self, lengths, geometry, costs, form_costs, budget, packing) -> None:
        n = len(lengths)
        self.n, self.lengths, self.budget, self.packing, self.fixed_ms = n, lengths, budget, packing, costs.fixed_ms
        self.best_ms, self.counts = [0.0] * (n + 1), [0] * (n + 1)
        self.parent: list[tuple[int, str]] = [(0, PADDED)] * (n + 1)
        linear_ms, quadratic_ms = prefill_row_terms_ms(geometry, costs)
        self.hull = PaddedHull(lengths, costs.fixed_ms, linear_ms, quadratic_ms, budget, self.best_ms, self.counts)
        self.pair_ms = costs.attention_ms * attention_gflops(1, 1, geometry)
        token_ms = costs.token_ms + costs.kv_ms * kv_mib(1, 1, geometry)
        own_pairs = self.pair_ms if packing == SEGMENTS else 0.0
        # prefix[x]: per-prompt packed terms of the first x prompts; tokens[x]: their tokens
        self.prefix, self.tokens = [0.0], [0]
        for length in lengths:
            self.prefix.append(self.prefix[-1] + token_ms * length + form_costs.packed_prompt_ms + own_pairs * length * length)
            self.tokens.append(self.tokens[-1] + length)
        caps = [cap for cap in (budget, form_costs.packed_max_tokens) if cap is not None]
        self.packed_tokens = min(caps) if caps else None  # most tokens of one packed run
        self.window: list[int] = []  # monotone deque [window_head:] of packed starts, by best_ms[i] - prefix[i]
        self.window_head, self.lowest = 0, 0  # lowest: first start whose packed run to x fits the budget

    def runs(self) -> list[tuple[int, int, str]]:
        """(start, end, form) of the optimal runs, in order."""
        hull, best_ms, counts, parent = self.hull, self.best_ms, self.counts, self.parent
        packed_option = {SEGMENTS: self._segments_option, DENSE: self._dense_option}.get(self.packing)
        for new in range(self.n):
            hull.push(new)
            x = new + 1
            start = hull.best_start(x)
            cost, count, form = hull.cost_ms(start, x), counts[start] + 1, PADDED
            if packed_option is not None:
                self._advance(new, x)
                packed_cost, packed_start = packed_option(x)
                if _better(packed_cost, counts[packed_start] + 1, cost, count):
                    cost, count, start, form = packed_cost, counts[packed_start] + 1, packed_start, PACKED
            best_ms[x], counts[x], parent[x] = cost, count, (start, form)
        runs, x = [], self.n
        while x > 0:
            start, form = parent[x]
            runs.append((start, x, form))
            x = start
        return runs[::-1]

    def _advance(self, new: int, x: int) -> None:
        """Push start `new` into the window deque; drop starts whose packed run to x exceeds the budget."""
        if self.packed_tokens is not None:
            while self.tokens[x] - self.tokens[self.lowest] > self.packed_tokens:
                self.lowest += 1
        if self.packing == DENSE:
            return
        best_ms, prefix, counts, window = self.best_ms, self.prefix, self.counts, self.window
        key = (best_ms[new] - prefix[new], counts[new])
        while len(window) > self.window_head and (best_ms[window[-1]] - prefix[window[-1]], counts[window[-1]]) >= key:
            window.pop()
        window.append(new)
        while self.window_head < len(window) and window[self.window_head] < self.lowest:
            self.window_head += 1

    def _segments_option(self, x: int) -> tuple[float, int]:
        """(cost, start) of the best packed last run ending at x: the window's front (inf: prompt x - 1
        alone is over the packed bound)."""
        if self.window_head == len(self.window):
            return math.inf, x - 1
        i = self.window[self.window_head]
        return self.best_ms[i] + self.fixed_ms + self.prefix[x] - self.prefix[i], i

    def _dense_option(self, x: int) -> tuple[float, int]:
        """(cost, start) of the best dense-packed last run ending at x (at most DENSE_MAX_PROMPTS starts;
        exact ties go to the earlier start, whose plan has no more forwards)."""
        best_ms, prefix, tokens = self.best_ms, self.prefix, self.tokens
        tail, pair_ms = self.fixed_ms + prefix[x], self.pair_ms
        return min(
            ((best_ms[i] - prefix[i] + tail + pair_ms * (tokens[x] - tokens[i]) ** 2, i)
             for i in range(max(self.lowest, x - DENSE_MAX_PROMPTS), x)),
            default=(math.inf, x - 1),
        )
