"""The auto route: the cost model picks ordinary generation or bucketed CB for each call, and the
DP buckets every CB admission (the first one and each refill) into prefill groups.

Auto never changes the caller's configuration and never retries another route: a model error or
out-of-memory in the chosen route propagates as it is."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autobucket.continuous import Finished
from autobucket.costs import CostCoefficients, ModelGeometry
from autobucket.ordinary import run_ordinary
from autobucket.planner import plan_prefill
from autobucket.route_choice import ROUTE_ORDINARY, choose_route

if TYPE_CHECKING:
    from autobucket.rollout import _Call


def run_auto(call: _Call) -> dict[tuple[int, int], Finished]:
    from autobucket.rollout import _run_continuous

    geometry, costs = call.rollout.geometry, call.rollout.costs
    lengths = [len(p) for p in call.prompts]
    started = time.perf_counter()
    decision = choose_route(
        lengths,
        call.sampling.max_new_tokens,
        call.sampling.continuous_batch_size,
        geometry,
        costs,
        max_tokens=call.config.prefill_max_tokens,
        max_positions=call.rollout.max_positions,
        ordinary_blocked_reason=_ordinary_blocked_reason(call),
        samples_per_prompt=call.sampling.n,
    )
    profile = call.profile
    profile.plan_ms += (time.perf_counter() - started) * 1e3
    profile.route = decision.route
    profile.estimated_ordinary_ms = decision.ordinary_ms
    profile.estimated_bucketed_ms = decision.bucketed_ms
    profile.decision_reason = decision.reason
    if decision.route == ROUTE_ORDINARY:
        profile.prefill_groups = [[list(range(len(call.prompts)))]]
        return run_ordinary(
            call.rollout.model, call.prompts, call.generation, call.selection, call.sampling.n,
            call.sampling.continuous_batch_size, profile, call.timer,
        )
    fits_first_admission = len(call.prompts) * call.sampling.n <= call.sampling.continuous_batch_size
    first_plan = decision.buckets if fits_first_admission else None
    return _run_continuous(call, _BucketPlanner(call, geometry, costs, first_plan))


def _ordinary_blocked_reason(call: _Call) -> str | None:
    if call.config.cache_capacity is not None:
        return f"an explicit cache_capacity={call.config.cache_capacity} was requested"
    if call.config.trim_cache:
        return "trim_cache=True was requested"
    return None


class _BucketPlanner:
    """Admission policy: DP buckets over the admitted prompts (survivors keep their rows)."""

    def __init__(
        self,
        call: _Call,
        geometry: ModelGeometry,
        costs: CostCoefficients,
        first_plan: Sequence[Sequence[int]] | None,
    ) -> None:
        self.call, self.geometry, self.costs = call, geometry, costs
        self.first_plan = first_plan  # the decision's DP plan, reused when it covers the first admission

    def __call__(self, admitted: Sequence[int]) -> list[list[int]]:
        if self.first_plan is not None:
            plan, self.first_plan = self.first_plan, None
            return [list(bucket) for bucket in plan]
        started = time.perf_counter()
        lengths = [len(self.call.prompts[index]) for index in admitted]
        plan = plan_prefill(
            lengths, self.geometry, self.costs, self.call.config.prefill_max_tokens, self.call.sampling.n
        )
        self.call.profile.plan_ms += (time.perf_counter() - started) * 1e3
        return [[admitted[position] for position in bucket] for bucket in plan.buckets]
