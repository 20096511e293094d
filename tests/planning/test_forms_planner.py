"""The forms planner (padded / packed / chunked) against brute force over its whole search space, and
its agreement with `plan_prefill` when packing is off."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from autobucket.costs.coefficients import (
    BENCH_QWEN2_GEOMETRY,
    CostCoefficients,
    attention_gflops,
    planning_token_limit,
    prefill_cost_ms,
    split_forward_tokens,
)
from autobucket.planning.forms import (
    CHUNKED,
    DENSE,
    DENSE_MAX_PROMPTS,
    PACKED,
    PADDED,
    SEGMENTS,
    FormCosts,
    chunked_cost_ms,
    packed_cost_ms,
    plan_forms,
)
from autobucket.planning.planner import plan_prefill, shared_prefill_costs
from autobucket.planning.route_choice import ROUTE_BUCKETED, FormOptions, choose_route

GEOMETRY = BENCH_QWEN2_GEOMETRY


def run_cost(members, geometry, costs, form_costs, budget, packing) -> tuple[float, str]:
    """Cheapest feasible form of one run (inf when none fits), straight from the cost functions."""
    options = []
    if budget is None or len(members) * max(members) <= budget:
        options.append((prefill_cost_ms(len(members), max(members), geometry, costs), PADDED))
    caps = [c for c in (budget, form_costs.packed_max_tokens) if c is not None]
    fits = not caps or sum(members) <= min(caps)
    if packing is not None and fits and (packing == SEGMENTS or len(members) <= DENSE_MAX_PROMPTS):
        options.append((packed_cost_ms(members, geometry, costs, form_costs, packing), PACKED))
    return min(options, default=(math.inf, ""))


def brute_force_ms(lengths, geometry, costs, form_costs, budget, packing, samples=1) -> float:
    costs = shared_prefill_costs(costs, samples)
    ordered = sorted(lengths, reverse=True)
    long = [n for n in ordered if budget is not None and n > budget]
    rest = ordered[len(long) :]
    total = sum(chunked_cost_ms(n, budget, geometry, costs) for n in long)
    if not rest:
        return total
    best = math.inf
    for cuts in itertools.product([False, True], repeat=len(rest) - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [len(rest)]
        runs = [rest[a:b] for a, b in itertools.pairwise(bounds)]
        best = min(best, sum(run_cost(r, geometry, costs, form_costs, budget, packing)[0] for r in runs))
    return total + best


def random_case(rng: random.Random):
    lengths = [rng.choice([1, 2, 3, 5, 8, 16, 40, 100, 300]) for _ in range(rng.randint(1, 7))]
    costs = CostCoefficients(
        fixed_ms=rng.choice([0.0, 1.0, 6.0, 50.0]), token_ms=rng.choice([0.0, 0.05, 0.1]),
        attention_ms=rng.choice([0.0, 12.7, 200.0]), kv_ms=rng.choice([0.0, 0.1, 1.0]),
    )  # fmt: skip
    form_costs = FormCosts(packed_prompt_ms=rng.choice([0.0, 0.15, 3.0]), packed_max_tokens=rng.choice([None, 50, 300]))
    budget = rng.choice([None, 64, 128, 400, 1000])
    return lengths, costs, form_costs, budget


@pytest.mark.parametrize("packing", [None, SEGMENTS, DENSE])
@pytest.mark.parametrize("seed", range(60))
def test_forms_dp_equals_brute_force_over_its_search_space(seed, packing):
    lengths, costs, form_costs, budget = random_case(random.Random(seed))
    samples = 1 + seed % 3
    plan = plan_forms(lengths, GEOMETRY, costs, budget, samples, packing, form_costs)
    want = brute_force_ms(lengths, GEOMETRY, costs, form_costs, budget, packing, samples)
    assert plan.cost_ms == pytest.approx(want, rel=1e-9, abs=1e-9)
    # the plan is what it says: every prompt once, each group feasible in its form, and its cost adds up
    assert sorted(i for g in plan.groups for i in g) == list(range(len(lengths)))
    shared = shared_prefill_costs(costs, samples)
    recomputed = 0.0
    for group, form in zip(plan.groups, plan.forms, strict=True):
        members = [lengths[i] for i in group]
        if form == CHUNKED:
            assert len(group) == 1 and budget is not None and members[0] > budget
            recomputed += chunked_cost_ms(members[0], budget, GEOMETRY, shared)
        else:
            cost, _ = run_cost(members, GEOMETRY, shared, form_costs, budget, packing if form == PACKED else None)
            if form == PACKED:
                cost = packed_cost_ms(members, GEOMETRY, shared, form_costs, packing)
            assert math.isfinite(cost)
            recomputed += cost
    assert recomputed == pytest.approx(plan.cost_ms, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", range(30))
def test_without_packing_the_forms_plan_is_plan_prefill(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 512) for _ in range(rng.randint(1, 60))]
    costs = CostCoefficients(fixed_ms=rng.choice([1.0, 6.0, 25.0]), token_ms=0.1, attention_ms=12.7, kv_ms=0.1)
    budget = rng.choice([None, 4096, 65536])
    plan = plan_forms(lengths, GEOMETRY, costs, budget, packing=None)
    reference = plan_prefill(lengths, GEOMETRY, costs, budget)
    assert plan.groups == reference.buckets and set(plan.forms) <= {PADDED}
    assert plan.cost_ms == pytest.approx(reference.cost_ms, rel=1e-12)


def test_a_prompt_over_the_budget_is_chunked_and_one_chunk_costs_one_forward():
    costs = CostCoefficients(fixed_ms=6.0, token_ms=0.1, attention_ms=12.7, kv_ms=0.1)
    plan = plan_forms([8192, 100, 50], GEOMETRY, costs, 1024)
    assert plan.groups[0] == (0,) and plan.forms[0] == CHUNKED
    assert set(plan.forms[1:]) <= {PADDED, PACKED}
    # a chunk as long as the prompt is the ordinary one-row prefill (the attention sum telescopes to L²)
    assert chunked_cost_ms(300, 300, GEOMETRY, costs) == pytest.approx(prefill_cost_ms(1, 300, GEOMETRY, costs))
    assert chunked_cost_ms(300, 100, GEOMETRY, costs) > chunked_cost_ms(300, 300, GEOMETRY, costs)


def test_dense_packing_pays_for_every_pair_of_the_row():
    costs = CostCoefficients(fixed_ms=0.0, token_ms=0.0, attention_ms=1.0, kv_ms=0.0)
    lengths, pair_ms = [30, 20, 10], attention_gflops(1, 1, GEOMETRY)
    dense = packed_cost_ms(lengths, GEOMETRY, costs, FormCosts(0.0), DENSE)
    segments = packed_cost_ms(lengths, GEOMETRY, costs, FormCosts(0.0), SEGMENTS)
    assert dense == pytest.approx(pair_ms * 60**2) and segments == pytest.approx(pair_ms * (900 + 400 + 100))


def test_packing_wins_on_the_spread_workload_and_padding_on_equal_lengths():
    costs = CostCoefficients(fixed_ms=5.741, token_ms=0.1037, attention_ms=12.70, kv_ms=0.1182)
    spread = plan_forms(range(16, 513, 16), GEOMETRY, costs, 65536, form_costs=FormCosts(packed_max_tokens=None))
    assert spread.forms == (PACKED,) and spread.cost_ms < plan_prefill(range(16, 513, 16), GEOMETRY, costs).cost_ms
    assert plan_forms([64] * 8, GEOMETRY, costs, 65536).forms == (PADDED,)  # nothing to unpad, no segment cost


@pytest.mark.parametrize("packing", [None, SEGMENTS, DENSE])
def test_the_super_linear_forward_term_caps_every_forward_like_plan_prefill(packing):
    costs = CostCoefficients(fixed_ms=5.0, token_ms=0.1, attention_ms=12.7, kv_ms=0.1, forward_sq_ms=2.0)
    cap = split_forward_tokens(costs)  # 2,236 tokens: above it two half forwards are cheaper
    lengths = [300] * 20 + [1500, 2400]
    plan = plan_forms(lengths, GEOMETRY, costs, 65536, packing=packing, form_costs=FormCosts(packed_max_tokens=None))
    for group, form in zip(plan.groups, plan.forms, strict=True):
        tokens = sum(lengths[i] for i in group) if form == PACKED else len(group) * max(lengths[i] for i in group)
        assert tokens <= max(cap, 2400), (group, form)
    if packing is None:
        assert plan.groups == plan_prefill(lengths, GEOMETRY, costs, planning_token_limit(65536, costs, 2400)).buckets


def test_packed_rows_stay_within_packed_max_tokens():
    costs = CostCoefficients(fixed_ms=5.741, token_ms=0.1037, attention_ms=12.70, kv_ms=0.1182)
    lengths = list(range(16, 513, 16))
    plan = plan_forms(lengths, GEOMETRY, costs, 65536)  # default bound: 2,048 tokens per packed row
    packed = [sum(lengths[i] for i in g) for g, f in zip(plan.groups, plan.forms, strict=True) if f == PACKED]
    assert packed and max(packed) <= 2048 and len(plan.groups) < 15  # fewer forwards than padded buckets


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"packing": "flex"}, "packing='flex' is invalid"),
        ({"prefill_max_tokens": 0}, "prefill_max_tokens"),
        ({"samples_per_prompt": 0}, "samples_per_prompt"),
    ],
)
def test_bad_planner_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_forms([4, 5], GEOMETRY, CostCoefficients(), **kwargs)


def test_bad_form_costs_and_lengths_are_rejected():
    with pytest.raises(ValueError, match="packed_prompt_ms=-1"):
        FormCosts(packed_prompt_ms=-1)
    with pytest.raises(ValueError, match="packed_max_tokens"):
        FormCosts(packed_max_tokens=0)
    with pytest.raises(ValueError, match="prompt 1 has length 0"):
        plan_forms([4, 0], GEOMETRY, CostCoefficients())


def test_route_choice_with_forms_accepts_long_prompts_and_reports_forms():
    lengths = [5000, 30, 20]
    decision = choose_route(lengths, 16, 32, GEOMETRY, CostCoefficients(), prefill_max_tokens=1024, forms=FormOptions(SEGMENTS))
    assert decision.route == ROUTE_BUCKETED and "exceed prefill_max_tokens" in decision.reason
    assert decision.forms[0] == CHUNKED and len(decision.forms) == len(decision.buckets)
    assert decision.bucketed_lower_bound_ms <= decision.bucketed_ms
    with pytest.raises(ValueError, match="prompt 0 has 5000 tokens"):
        choose_route(lengths, 16, 32, GEOMETRY, CostCoefficients(), prefill_max_tokens=1024)


@pytest.mark.parametrize("seed", range(20))
def test_the_route_lower_bound_holds_for_form_plans(seed):
    lengths, costs, form_costs, budget = random_case(random.Random(seed + 100))
    for packing in (SEGMENTS, DENSE):
        decision = choose_route(lengths, 8, 64, GEOMETRY, costs, prefill_max_tokens=budget,
                                ordinary_blocked_reason="test", forms=FormOptions(packing, form_costs))  # fmt: skip
        assert decision.bucketed_lower_bound_ms <= decision.bucketed_ms * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_the_coefficients_packed_prompt_ms_reaches_the_plan_and_flips_it(seed):
    """With no explicit `FormCosts`, the plan is brute force's under `FormCosts.of(costs)`; a free packed
    prompt packs the whole admission, a prohibitive one pads it."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, 60) for _ in range(rng.randint(2, 6))]
    lengths[0] = lengths[1] + 1  # at least one padded token
    costs = CostCoefficients(fixed_ms=50.0, token_ms=0.1, attention_ms=12.7, kv_ms=0.1)
    choices = {}
    for packed_prompt_ms in (0.0, rng.choice([0.05, 0.3, 2.0]), 1e6):
        case = CostCoefficients(**{**costs.to_dict(), "packed_prompt_ms": packed_prompt_ms})
        plan = plan_forms(lengths, GEOMETRY, case, 2048, packing=SEGMENTS)
        want = brute_force_ms(lengths, GEOMETRY, case, FormCosts.of(case), 2048, SEGMENTS)
        assert plan.cost_ms == pytest.approx(want, rel=1e-9)
        choices[packed_prompt_ms] = plan.forms
        decision = choose_route(lengths, 4, 64, GEOMETRY, case, 2048, ordinary_blocked_reason="test",
                                forms=FormOptions(SEGMENTS))  # fmt: skip
        assert decision.forms == plan.forms
    assert choices[0.0] == (PACKED,) and choices[1e6] == (PADDED,) * len(choices[1e6])
