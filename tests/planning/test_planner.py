"""Prefill planner and route choice, checked against brute-force oracles."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autobucket.costs.coefficients import (
    CostCoefficients,
    ModelGeometry,
    continuous_decode_cost_ms,
    ordinary_cost_ms,
    prefill_cost_ms,
)
from autobucket.planning import planner
from autobucket.planning.planner import PrefillPlan, plan_prefill
from autobucket.planning.route_choice import RouteDecision, choose_route

# Qwen2.5-3B (the reference's examples): 36 layers, 16 query / 2 KV heads of 128, fp32.
QWEN25_3B = ModelGeometry(
    layers=36, query_heads=16, kv_heads=2, head_dim=128, element_bytes=4, max_positions=32768
)
REL = 1e-9


# ---- oracles --------------------------------------------------------------------------------------------


def descending_order(lengths: list[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))


def all_partitions(n: int, start: int = 0):
    """Every split of positions start..n-1 into contiguous runs, as lists of (start, end) pairs."""
    if start == n:
        yield []
        return
    for end in range(start + 1, n + 1):
        for rest in all_partitions(n, end):
            yield [(start, end), *rest]


def brute_force(lengths, geometry, costs, max_tokens):
    """(cost, bucket count) of every feasible contiguous partition of the length-descending order."""
    ordered = [lengths[index] for index in descending_order(lengths)]
    results = []
    for partition in all_partitions(len(ordered)):
        runs = [(end - start, ordered[start]) for start, end in partition]
        if max_tokens is not None and any(rows * width > max_tokens for rows, width in runs):
            continue
        cost = sum(prefill_cost_ms(rows, width, geometry, costs) for rows, width in runs)
        results.append((cost, len(runs)))
    return results


def quadratic_dp_cost(lengths, geometry, costs, max_tokens):
    """A plain O(n²) DP over the sorted order: a second oracle for sizes brute force cannot reach."""
    ordered = [lengths[index] for index in descending_order(lengths)]
    best = [0.0] + [math.inf] * len(ordered)
    for end in range(1, len(ordered) + 1):
        for start in range(end):
            rows, width = end - start, ordered[start]
            if max_tokens is None or rows * width <= max_tokens:
                best[end] = min(best[end], best[start] + prefill_cost_ms(rows, width, geometry, costs))
    return best[-1]


def recomputed_cost(plan: PrefillPlan, geometry, costs) -> float:
    return sum(
        prefill_cost_ms(len(b), w, geometry, costs) for b, w in zip(plan.buckets, plan.widths, strict=True)
    )


def assert_well_formed(plan: PrefillPlan, lengths, max_tokens) -> None:
    order = descending_order(lengths)
    assert [index for bucket in plan.buckets for index in bucket] == order
    for bucket, width in zip(plan.buckets, plan.widths, strict=True):
        assert width == lengths[bucket[0]] == max(lengths[index] for index in bucket)
        assert max_tokens is None or len(bucket) * width <= max_tokens


def assert_optimal(plan: PrefillPlan, lengths, geometry, costs, max_tokens) -> None:
    assert_well_formed(plan, lengths, max_tokens)
    assert math.isclose(plan.cost_ms, recomputed_cost(plan, geometry, costs), rel_tol=1e-12)
    best_cost = min(cost for cost, _ in brute_force(lengths, geometry, costs, max_tokens))
    assert math.isclose(plan.cost_ms, best_cost, rel_tol=REL, abs_tol=1e-12), (plan, best_cost)


# ---- strategies -----------------------------------------------------------------------------------------

coefficient = st.one_of(st.just(0.0), st.floats(0.0, 100.0, allow_nan=False, allow_infinity=False))
cost_coefficients = st.builds(
    CostCoefficients,
    fixed_ms=coefficient,
    token_ms=coefficient,
    attention_ms=coefficient,
    kv_ms=coefficient,
    decode_ms=coefficient,
)
geometries = st.builds(
    ModelGeometry,
    layers=st.integers(1, 40),
    query_heads=st.integers(1, 32),
    kv_heads=st.integers(1, 8),
    head_dim=st.sampled_from([32, 64, 128]),
    element_bytes=st.sampled_from([2, 4]),
)


@st.composite
def length_lists_and_limits(draw, max_size=10, max_length=600):
    lengths = draw(st.lists(st.integers(1, max_length), min_size=1, max_size=max_size))
    # Limits between the longest prompt and twice the total make some buckets infeasible.
    limit = st.integers(max(lengths), max(max(lengths), 2 * sum(lengths) // 3))
    return lengths, draw(st.one_of(st.none(), limit))


# ---- plan_prefill vs brute force ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(case=length_lists_and_limits(), geometry=geometries, costs=cost_coefficients)
def test_dp_equals_brute_force(case, geometry, costs):
    lengths, max_tokens = case
    plan = plan_prefill(lengths, geometry, costs, max_tokens)
    assert_optimal(plan, lengths, geometry, costs, max_tokens)
    singletons = sum(prefill_cost_ms(1, width, geometry, costs) for width in lengths)
    assert plan.cost_ms <= singletons * (1 + REL) + 1e-12
    n, longest = len(lengths), max(lengths)
    if max_tokens is None or n * longest <= max_tokens:
        assert plan.cost_ms <= prefill_cost_ms(n, longest, geometry, costs) * (1 + REL) + 1e-12


@settings(max_examples=200, deadline=None)
@given(
    case=length_lists_and_limits(max_length=20),
    fixed=st.integers(0, 60),
    token=st.integers(0, 4),
)
def test_exact_ties_choose_the_fewest_buckets(case, fixed, token):
    # Integer costs make every sum exact, so the lexicographic (cost, count) optimum is well defined.
    lengths, max_tokens = case
    costs = CostCoefficients(fixed_ms=fixed, token_ms=token, attention_ms=0, kv_ms=0)
    geometry = QWEN25_3B
    plan = plan_prefill(lengths, geometry, costs, max_tokens)
    assert_well_formed(plan, lengths, max_tokens)
    assert (plan.cost_ms, len(plan.buckets)) == min(brute_force(lengths, geometry, costs, max_tokens))


def test_hand_constructed_tie_prefers_one_bucket():
    # One bucket: 10 + 3·10 = 40. [10] + [5, 5]: (10 + 10) + (10 + 10) = 40 as well.
    costs = CostCoefficients(fixed_ms=10, token_ms=1, attention_ms=0, kv_ms=0)
    plan = plan_prefill([5, 10, 5], QWEN25_3B, costs)
    assert plan == PrefillPlan(buckets=((1, 0, 2),), widths=(10,), cost_ms=40.0)
    assert min(brute_force([5, 10, 5], QWEN25_3B, costs, None)) == (40.0, 1)
    assert sorted(brute_force([5, 10, 5], QWEN25_3B, costs, None))[1] == (40.0, 2)  # the tie is real


def test_all_zero_costs_use_the_fewest_buckets_the_limit_allows():
    zero = CostCoefficients(0, 0, 0, 0, 0)
    assert len(plan_prefill([7, 3, 9, 1, 4], QWEN25_3B, zero).buckets) == 1
    # Equal cost and count: earlier buckets fill up first.
    assert plan_prefill([10] * 7, QWEN25_3B, zero, prefill_max_tokens=30).rows == (3, 3, 1)


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(2, 40),
    width=st.integers(1, 600),
    token=st.floats(0.001, 10),
    attention=st.floats(0.001, 10),
    kv=st.floats(0.001, 10),
)
def test_equal_lengths_without_fixed_cost_stay_in_one_bucket_despite_rounding(n, width, token, attention, kv):
    # Every split costs the same mathematically; float rounding must not scatter the prompts.
    costs = CostCoefficients(fixed_ms=0, token_ms=token, attention_ms=attention, kv_ms=kv)
    assert len(plan_prefill([width] * n, QWEN25_3B, costs, prefill_max_tokens=None).buckets) == 1


@pytest.mark.parametrize("n", [50, 200, 400])
@pytest.mark.parametrize("max_length", [512, 65536])
@pytest.mark.parametrize("max_tokens", [65536, None])
def test_large_inputs_match_a_quadratic_dp(n, max_length, max_tokens):
    rng = random.Random(n * 7 + max_length)
    lengths = [rng.randint(1, max_length) for _ in range(n)]
    for costs in (CostCoefficients(), CostCoefficients(fixed_ms=500.0, attention_ms=0.0)):
        plan = plan_prefill(lengths, QWEN25_3B, costs, max_tokens)
        assert_well_formed(plan, lengths, max_tokens)
        expected = quadratic_dp_cost(lengths, QWEN25_3B, costs, max_tokens)
        assert math.isclose(plan.cost_ms, expected, rel_tol=REL)


def test_negative_control_a_broken_dp_fails_the_oracle(monkeypatch):
    # A DP that always opens a new bucket (every takeover immediate) yields singletons; the oracle must object.
    monkeypatch.setattr(planner, "_takeover_x", lambda new, old, first_x, *rest: first_x)
    lengths, costs = [512] + [16] * 5, CostCoefficients(fixed_ms=5000.0)
    plan = plan_prefill(lengths, QWEN25_3B, costs)
    assert len(plan.buckets) == len(lengths)
    with pytest.raises(AssertionError):
        assert_optimal(plan, lengths, QWEN25_3B, costs, 65536)


# ---- reference examples (Qwen2.5-3B geometry, default coefficients) ------------------------------------


def test_long_tail_512_plus_31x16_gives_two_buckets():
    plan = plan_prefill([512] + [16] * 31, QWEN25_3B, CostCoefficients())
    assert plan.buckets == ((0,), tuple(range(1, 32)))
    assert plan.widths == (512, 16)
    assert plan.rows == (1, 31) and plan.padded_tokens == (512, 496)


def test_long_tail_with_large_fixed_cost_gives_one_bucket():
    plan = plan_prefill([16] * 31 + [512], QWEN25_3B, CostCoefficients(fixed_ms=5000.0))
    assert plan.buckets == ((31, *range(31)),)
    assert plan.widths == (512,)


def test_token_limit_boundaries():
    huge_fixed = CostCoefficients(fixed_ms=1e6)  # always prefer fewer buckets
    assert plan_prefill([512] * 128, QWEN25_3B, huge_fixed).rows == (128,)
    assert plan_prefill([512] * 129, QWEN25_3B, huge_fixed).rows == (128, 1)
    assert plan_prefill([512] * 129, QWEN25_3B, CostCoefficients()).rows == (128, 1)
    assert plan_prefill([512] * 129, QWEN25_3B, huge_fixed, prefill_max_tokens=None).rows == (129,)
    assert plan_prefill([65536], QWEN25_3B, huge_fixed).rows == (1,)
    with pytest.raises(ValueError, match=r"prompt 1 has 65537 tokens.*prefill_max_tokens=65536"):
        plan_prefill([3, 65537], QWEN25_3B, huge_fixed)
    assert plan_prefill([3, 65537], QWEN25_3B, huge_fixed, prefill_max_tokens=None).widths == (65537,)


def test_sorted_order_is_stable_and_longest_first():
    plan = plan_prefill([4, 9, 4, 9, 1], QWEN25_3B, CostCoefficients(fixed_ms=1e6))
    assert plan.buckets == ((1, 3, 0, 2, 4),)


def test_empty_input_gives_an_empty_plan():
    assert plan_prefill([], QWEN25_3B, CostCoefficients()) == PrefillPlan((), (), 0.0)


def test_numpy_lengths_are_accepted():
    lengths = np.array([512] + [16] * 31)
    plan = plan_prefill(lengths, QWEN25_3B, CostCoefficients())
    assert plan.buckets == ((0,), tuple(range(1, 32)))
    assert all(type(index) is int for bucket in plan.buckets for index in bucket)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "5", None])
def test_bad_lengths_name_the_prompt_index(bad):
    with pytest.raises(ValueError, match=rf"prompt 2 has length {bad!r}"):
        plan_prefill([5, 6, bad, 7], QWEN25_3B, CostCoefficients())


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "65536"])
def test_bad_max_tokens_is_rejected(bad):
    with pytest.raises(ValueError, match="max_tokens"):
        plan_prefill([5], QWEN25_3B, CostCoefficients(), prefill_max_tokens=bad)


def test_plan_validates_itself():
    with pytest.raises(ValueError, match="widths"):
        PrefillPlan(((0,),), (), 1.0)
    with pytest.raises(ValueError, match="empty"):
        PrefillPlan(((),), (3,), 1.0)
    with pytest.raises(ValueError, match="cost_ms"):
        PrefillPlan(((0,),), (3,), float("nan"))


# ---- choose_route ---------------------------------------------------------------------------------------


def route(lengths, **kwargs) -> RouteDecision:
    options = {"max_new_tokens": 16, "continuous_batch_size": 32, "geometry": QWEN25_3B, "costs": CostCoefficients()}
    return choose_route(lengths, **{**options, **kwargs})


def test_uniform_short_prompts_choose_ordinary_and_skip_the_dp():
    decision = route([16] * 32)
    assert decision.route == "ordinary"
    assert decision.buckets == () and decision.bucketed_ms is None
    assert decision.bucketed_lower_bound_ms >= decision.ordinary_ms
    assert "DP skipped" in decision.reason


def test_long_tail_chooses_two_buckets():
    decision = route([512] + [16] * 31)
    assert decision.route == "bucketed"
    assert decision.buckets == ((0,), tuple(range(1, 32)))
    plan = plan_prefill([512] + [16] * 31, QWEN25_3B, CostCoefficients())
    assert decision.bucketed_ms == pytest.approx(plan.cost_ms + 150.0)
    assert decision.ordinary_ms == pytest.approx(ordinary_cost_ms(32, 512, 16, QWEN25_3B, CostCoefficients()))
    assert "bucketed estimated cheaper" in decision.reason


@pytest.mark.parametrize(
    ("lengths", "kwargs", "reason"),
    [
        ([16] * 40, {}, "40 rows exceed continuous_batch_size 32"),
        ([16] * 4, {"continuous_batch_size": 3}, "4 rows exceed continuous_batch_size 3"),
        ([16] * 8, {"prefill_max_tokens": 100}, "8 rows x 16 tokens = 128 padded tokens exceed prefill_max_tokens 100"),
        ([16] * 8, {"max_positions": 31}, "longest prompt 16 + 16 new tokens exceeds max_positions 31"),
        (
            [16] * 8,
            {"ordinary_blocked_reason": "an explicit cache_capacity was requested"},
            "an explicit cache_capacity was requested",
        ),
    ],
)
def test_ineligible_ordinary_forces_bucketed(lengths, kwargs, reason):
    assert route(lengths, continuous_batch_size=64).route == "ordinary"  # control: eligible, this batch goes ordinary
    decision = route(lengths, **kwargs)
    assert decision.route == "bucketed"
    assert decision.ordinary_ms is None and decision.bucketed_ms is not None
    assert decision.buckets and decision.reason == f"ordinary ineligible: {reason}"


def test_position_limit_is_inclusive():
    assert route([16] * 8, max_positions=32).route == "ordinary"


def test_equal_estimates_choose_ordinary_after_the_dp():
    # One bucket is optimal (tie with [10] + [5, 5]); without KV copy and CB decode terms bucketed == ordinary.
    costs = CostCoefficients(fixed_ms=10, token_ms=1, attention_ms=0, kv_ms=0, decode_ms=0)
    decision = route([5, 10, 5], costs=costs)
    assert decision.ordinary_ms == decision.bucketed_ms == 40.0
    assert decision.route == "ordinary" and decision.buckets == ((1, 0, 2),)


def test_slow_ordinary_decode_extension_can_favour_bucketed_for_uniform_prompts():
    costs = CostCoefficients(kv_ms=0, decode_ms=0, ordinary_decode_ms=2.0)
    assert route([16] * 32, costs=CostCoefficients(kv_ms=0, decode_ms=0)).route == "ordinary"
    decision = route([16] * 32, costs=costs)
    assert decision.route == "bucketed" and decision.buckets == (tuple(range(32)),)
    assert decision.ordinary_ms - decision.bucketed_ms == pytest.approx(2.0 * 15)


def test_ordinary_decode_kv_extension_grows_with_context():
    costs = CostCoefficients(decode_ms=0.0, ordinary_decode_kv_ms=1.0)
    short = route([16] * 32, costs=costs, max_new_tokens=2)
    long = route([16] * 32, costs=costs, max_new_tokens=64)
    assert long.ordinary_ms - short.ordinary_ms > 0
    assert long.route == "bucketed"


def test_empty_batch_goes_ordinary_unless_blocked():
    decision = route([])
    assert (decision.route, decision.buckets, decision.ordinary_ms, decision.bucketed_ms) == (
        "ordinary",
        (),
        0.0,
        0.0,
    )
    blocked = route([], ordinary_blocked_reason="trimming requested")
    assert (
        blocked.route == "bucketed" and blocked.ordinary_ms is None and "trimming requested" in blocked.reason
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"continuous_batch_size": 0}, "continuous_batch_size"),
        ({"continuous_batch_size": 2.0}, "continuous_batch_size"),
        ({"max_positions": 0}, "max_positions"),
        ({"prefill_max_tokens": 0}, "prefill_max_tokens"),
    ],
)
def test_choose_route_validates_its_inputs(kwargs, field):
    with pytest.raises(ValueError, match=field):
        route([16, 8], **kwargs)


def test_choose_route_rejects_bad_lengths_even_when_the_dp_would_be_skipped():
    with pytest.raises(ValueError, match="prompt 1"):
        route([16, 0])
    with pytest.raises(ValueError, match="prompt 0 has 70000 tokens"):
        route([70000])


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 600), min_size=1, max_size=12),
    costs=cost_coefficients,
    max_new_tokens=st.integers(1, 64),
)
def test_lower_bound_holds_and_skipping_is_safe(lengths, costs, max_new_tokens):
    decision = route(lengths, costs=costs, max_new_tokens=max_new_tokens, continuous_batch_size=64, prefill_max_tokens=None)
    dp_cost = plan_prefill(lengths, QWEN25_3B, costs, prefill_max_tokens=None).cost_ms
    bucketed_ms = dp_cost + continuous_decode_cost_ms(max_new_tokens, costs)
    assert decision.bucketed_lower_bound_ms <= bucketed_ms * (1 + REL) + 1e-12
    assert decision.ordinary_ms is not None
    if decision.bucketed_ms is None:
        assert decision.route == "ordinary" and decision.buckets == ()
        assert decision.ordinary_ms <= bucketed_ms * (1 + REL) + 1e-12
    else:
        assert decision.bucketed_ms == pytest.approx(bucketed_ms, rel=REL, abs=1e-12)
        assert (decision.route == "ordinary") == (decision.ordinary_ms <= decision.bucketed_ms)


def test_route_decision_validates_itself():
    with pytest.raises(ValueError, match="route"):
        RouteDecision("fast", (), (), 1.0, 1.0, 1.0, "")
    with pytest.raises(ValueError, match="ordinary_ms"):
        RouteDecision("ordinary", (), (), None, 1.0, 1.0, "")
    with pytest.raises(ValueError, match="bucketed_ms"):
        RouteDecision("bucketed", ((0,),), (3,), None, None, 1.0, "")


# ---- no torch -------------------------------------------------------------------------------------------


def test_planner_imports_without_torch():
    code = (
        "import sys, autobucket.planning.planner, autobucket.planning.route_choice, autobucket.costs.coefficients, autobucket.cli.main; "
        "assert 'torch' not in sys.modules, 'torch was imported'; "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
