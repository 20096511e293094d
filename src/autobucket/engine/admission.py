"""Admission policies: how each admission's prompts are split into prefill groups, one per CB route.

A policy receives the admission's prompt indices (only prompts not yet prefilled) and returns
`PrefillGroup`s: a padded group is one left-padded forward, a packed group one unpadded forward of
the prompts concatenated, a chunked group one prompt in forwards of at most `prefill_max_tokens`.

- `equal_width_groups`: one padded group per admission (split in input order only where it would pass
  the token budget);
- `aligned_groups`: one group per prompt;
- `PlannedGroups` (bucketed and auto): the forms planner's exact DP over the admission's length-sorted
  prompts; auto's first admission reuses its route decision's plan.

Every policy chunks a prompt longer than the budget: `prefill_max_tokens` is a per-forward budget."""

from __future__ import annotations

import time
from collections.abc import Sequence

from autobucket.engine.batching.packed_prefill import packing_attention
from autobucket.engine.batching.prefill import PrefillGroup
from autobucket.engine.route_call import RouteCall
from autobucket.planning.forms import CHUNKED, PADDED, plan_forms
from autobucket.planning.planner import plan_prefill
from autobucket.planning.route_choice import FormOptions, RouteDecision


def equal_width_groups(call: RouteCall, admitted: Sequence[int]) -> list[PrefillGroup]:
    """One padded group per admission, split in input order only where it would pass the token limit;
    a prompt longer than the limit is chunked on its own."""
    limit = call.config.prefill_max_tokens
    long, groups = _chunked_groups(call, admitted), [[]]
    chunked = {g.prompts[0] for g in long}
    for index in admitted:
        if index in chunked:
            continue
        width = max([len(call.prompts[i]) for i in groups[-1]] + [len(call.prompts[index])])
        if groups[-1] and limit is not None and width * (len(groups[-1]) + 1) > limit:
            groups.append([])
        groups[-1].append(index)
    return long + [PrefillGroup(tuple(g)) for g in groups if g]


def aligned_groups(call: RouteCall, admitted: Sequence[int]) -> list[PrefillGroup]:
    """One forward per prompt; a prompt longer than the token limit in chunks."""
    return [_own_group(call, i) for i in admitted]


def _chunked_groups(call: RouteCall, admitted: Sequence[int]) -> list[PrefillGroup]:
    return [group for group in (_own_group(call, i) for i in admitted) if group.form == CHUNKED]


def _own_group(call: RouteCall, index: int) -> PrefillGroup:
    """Prompt `index` prefilled on its own: one forward, or chunks when it is over the token limit."""
    limit = call.config.prefill_max_tokens
    if limit is not None and len(call.prompts[index]) > limit:
        return PrefillGroup((index,), CHUNKED, limit)
    return PrefillGroup((index,))


def form_options(call: RouteCall) -> FormOptions:
    """How this call's model can pack prompts (per-segment SDPA or a dense mask; None: not at all)."""
    return FormOptions(packing=packing_attention(call.model) if call.config.packing else None)


class PlannedGroups:
    """Admission policy: the forms planner's groups over the admitted prompts (padded, packed or chunked;
    survivors keep their rows)."""

    def __init__(self, call: RouteCall, first_plan: Sequence[PrefillGroup] | None) -> None:
        self.call = call
        self.first_plan = first_plan  # a route decision's plan, reused when it covers the first admission

    def __call__(self, admitted: Sequence[int]) -> list[PrefillGroup]:
        if self.first_plan is not None:
            plan, self.first_plan = self.first_plan, None
            if sorted(i for g in plan for i in g.prompts) == sorted(admitted):
                return list(plan)
        call = self.call
        started = time.perf_counter()
        lengths = [len(call.prompts[index]) for index in admitted]
        options = form_options(call)
        limit = call.config.prefill_max_tokens
        plan = plan_forms(lengths, call.geometry, call.costs, limit, call.sampling.n, options.packing, options.costs)
        call.profile.plan_ms += (time.perf_counter() - started) * 1e3
        return [
            PrefillGroup(tuple(admitted[position] for position in group), form, limit if form == CHUNKED else None)
            for group, form in zip(plan.groups, plan.forms, strict=True)
        ]


def decision_groups(decision: RouteDecision, limit: int | None) -> list[PrefillGroup]:
    forms = decision.forms or (PADDED,) * len(decision.buckets)
    return [
        PrefillGroup(tuple(g), form, limit if form == CHUNKED else None)
        for g, form in zip(decision.buckets, forms, strict=True)
    ]


# ------------------------------------------------------------------ continued prompts (prefix cache hits)
# A continuation policy groups the prompts whose prefixes came from the prefix cache: (their indices,
# their suffix lengths = tokens still to prefill) -> groups of those indices, each one continued
# forward; a suffix over the token budget is always continued alone, in chunks.


def continued_aligned(call: RouteCall, indices: Sequence[int], suffix_lengths: Sequence[int]) -> list[list[int]]:
    """One continued forward per prompt (the aligned route)."""
    return [[index] for index in indices]


def continued_equal_width(call: RouteCall, indices: Sequence[int], suffix_lengths: Sequence[int]) -> list[list[int]]:
    """One continued forward for all (the equal-width route), split in input order only at the token budget."""
    limit, over = call.config.prefill_max_tokens, _over_budget(call, suffix_lengths)
    groups: list[list[int]] = [[]]
    widest = 0
    for position, index in enumerate(indices):
        if position in over:
            continue
        widest = max(widest, suffix_lengths[position])
        if groups[-1] and limit is not None and widest * (len(groups[-1]) + 1) > limit:
            groups.append([])
            widest = suffix_lengths[position]
        groups[-1].append(index)
    return [[indices[i]] for i in over] + [g for g in groups if g]


def continued_planned(call: RouteCall, indices: Sequence[int], suffix_lengths: Sequence[int]) -> list[list[int]]:
    """The padded-bucket DP over the suffix lengths (the bucketed and auto routes)."""
    over = _over_budget(call, suffix_lengths)
    rest = [i for i in range(len(indices)) if i not in over]
    limit = call.config.prefill_max_tokens
    plan = plan_prefill([suffix_lengths[i] for i in rest], call.geometry, call.costs, limit, call.sampling.n)
    return [[indices[i]] for i in over] + [[indices[rest[i]] for i in bucket] for bucket in plan.buckets]


def _over_budget(call: RouteCall, suffix_lengths: Sequence[int]) -> set[int]:
    limit = call.config.prefill_max_tokens
    return {i for i, length in enumerate(suffix_lengths) if limit is not None and length > limit}
