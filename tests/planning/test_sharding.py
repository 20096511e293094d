"""Sharding prompt groups over workers (pure: no torch, no ray).

Oracle: brute force over every assignment for small instances; LPT must stay within Graham's bound
4/3 - 1/(3m) of the optimal makespan, and a deliberately bad assignment must not.
"""

from __future__ import annotations

import itertools
import random

import pytest

from autobucket.costs.coefficients import BENCH_QWEN2_GEOMETRY, CostCoefficients, prefill_cost_ms
from autobucket.planning.sharding import imbalance, plan_shards, prompt_cost_ms

COSTS = CostCoefficients()


def long_tail_lengths(count: int, seed: int) -> list[int]:
    """The reference's long-tail ratio (1 x 512 per 15 x 16 tokens), shuffled: count/16 long prompts."""
    lengths = [512] * (count // 16) + [16] * (count - count // 16)
    random.Random(seed).shuffle(lengths)
    return lengths


def optimal_makespan(costs: list[float], workers: int) -> float:
    best = float("inf")
    for owners in itertools.product(range(workers), repeat=len(costs)):
        loads = [0.0] * workers
        for cost, owner in zip(costs, owners, strict=True):
            loads[owner] += cost
        best = min(best, max(loads))
    return best


def test_every_group_is_assigned_once_and_loads_are_sums() -> None:
    costs = [5.0, 1.0, 3.0, 3.0, 2.0, 8.0, 0.0]
    plan = plan_shards(costs, 3)
    assigned = sorted(index for shard in plan.shards for index in shard)
    assert assigned == list(range(len(costs)))
    assert all(list(shard) == sorted(shard) for shard in plan.shards)
    assert plan.predicted_ms == tuple(sum(costs[i] for i in shard) for shard in plan.shards)


@pytest.mark.parametrize("workers", [2, 3])
def test_longest_first_is_within_grahams_bound_of_brute_force(workers: int) -> None:
    rng = random.Random(workers)
    bound = 4 / 3 - 1 / (3 * workers)
    worst_ratio = 1.0
    for _ in range(60):
        costs = [rng.choice([rng.uniform(0, 10), float(rng.randrange(1, 8))]) for _ in range(rng.randrange(1, 9))]
        optimum = optimal_makespan(costs, workers)
        ratio = max(plan_shards(costs, workers).predicted_ms) / optimum if optimum else 1.0
        assert ratio <= bound + 1e-9, (costs, ratio)
        worst_ratio = max(worst_ratio, ratio)
    # Negative control: the oracle can fail — round robin on an adversarial order breaks the bound.
    adversarial = [10.0, 1.0, 10.0, 1.0, 10.0, 1.0]
    round_robin = max(plan_shards(adversarial, 2, "round_robin").predicted_ms)
    assert round_robin / optimal_makespan(adversarial, 2) > 4 / 3 - 1 / 6
    assert worst_ratio >= 1.0


# Coefficients fitted on the 20.3M benchmark Qwen2 on a 2-core CPU (docs: ENVIRONMENT.md).
CPU_COSTS = CostCoefficients(fixed_ms=5.8, token_ms=0.0537, attention_ms=10.0, kv_ms=0.0, decode_ms=0.0)


@pytest.mark.parametrize("costs", [COSTS, CPU_COSTS], ids=["default", "cpu"])
def test_cost_sharding_balances_a_long_tail_better_than_round_robin(costs: CostCoefficients) -> None:
    for seed in range(10):
        lengths = long_tail_lengths(128, seed)
        unit_costs = [prompt_cost_ms(length, 16, BENCH_QWEN2_GEOMETRY, costs) for length in lengths]
        balanced = plan_shards(unit_costs, 2, "cost")
        naive = plan_shards(unit_costs, 2, "round_robin")
        assert balanced.imbalance <= naive.imbalance + 1e-12  # float sums: equal splits may differ in ulps
        assert balanced.imbalance < 1.01  # many small groups: LPT is within one small group of perfect
    # Seed 1 puts 6 of the 8 long prompts at even positions: round robin gives them all to worker 0.
    unit_costs = [prompt_cost_ms(length, 16, BENCH_QWEN2_GEOMETRY, costs) for length in long_tail_lengths(128, 1)]
    assert plan_shards(unit_costs, 2, "round_robin").imbalance > 1.04
    assert plan_shards(unit_costs, 2, "cost").imbalance < 1.001


def test_prompt_cost_is_a_singleton_prefill_of_prompt_and_generated_tokens() -> None:
    geometry = BENCH_QWEN2_GEOMETRY
    assert prompt_cost_ms(100, 17, geometry, COSTS) == pytest.approx(prefill_cost_ms(1, 116, geometry, COSTS))
    assert prompt_cost_ms(100, 1, geometry, COSTS) == pytest.approx(prefill_cost_ms(1, 100, geometry, COSTS))
    # n samples share the prefill and pay the decode share n times.
    one, four = prompt_cost_ms(100, 17, geometry, COSTS), prompt_cost_ms(100, 17, geometry, COSTS, samples=4)
    prefill = prefill_cost_ms(1, 100, geometry, COSTS)
    assert four - prefill == pytest.approx(4 * (one - prefill))
    assert prompt_cost_ms(101, 17, geometry, COSTS) > one < prompt_cost_ms(100, 18, geometry, COSTS)


def test_more_workers_than_groups_and_no_groups() -> None:
    plan = plan_shards([4.0, 2.0], 4)
    assert plan.shards == ((0,), (1,), (), ())
    assert plan.imbalance == pytest.approx(4.0 / 1.5)
    empty = plan_shards([], 3)
    assert empty.shards == ((), (), ()) and empty.imbalance == 1.0


def test_ties_are_deterministic_and_go_to_the_lower_worker() -> None:
    assert plan_shards([1.0] * 5, 2).shards == ((0, 2, 4), (1, 3))
    assert plan_shards([1.0] * 5, 2, "round_robin").shards == ((0, 2, 4), (1, 3))


def test_imbalance_is_max_over_mean() -> None:
    assert imbalance([3.0, 1.0]) == pytest.approx(1.5)
    assert imbalance([0.0, 0.0]) == 1.0
    assert imbalance([]) == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1.0], 0), "num_workers=0"),
        (([1.0], True), "num_workers=True"),
        (([1.0, -1.0], 2), "group 1 has cost -1.0"),
        (([float("nan")], 2), "group 0 has cost nan"),
        (([1.0], 2, "random"), "strategy='random'"),
    ],
)
def test_bad_input_names_the_field(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        plan_shards(*args)
