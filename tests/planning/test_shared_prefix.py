"""Finding and costing prefixes shared inside one admission (`planning/shared_prefix.py`, pure), against
brute force over the prompts' pairs and the cost functions themselves."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from autobucket.costs.coefficients import BENCH_QWEN2_GEOMETRY, CostCoefficients
from autobucket.planning.route_choice import ROUTE_BUCKETED, ROUTE_ORDINARY, choose_route
from autobucket.planning.shared_prefix import (
    SharedPrefix,
    find_shared_prefixes,
    plan_shared_prefixes,
    shared_prefix_saving_ms,
)

GEOMETRY = BENCH_QWEN2_GEOMETRY


def _common(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _prompts_with_families(rng: random.Random, families: int, members: int) -> list[list[int]]:
    """Prompts built from a few shared heads of random lengths, with random tails (some empty)."""
    heads = [[rng.randrange(4) for _ in range(rng.randint(0, 12))] for _ in range(families)]
    return [rng.choice(heads) + [rng.randrange(4) for _ in range(rng.randint(1, 6))] for _ in range(members)]


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 10**6), families=st.integers(1, 4), members=st.integers(1, 12), minimum=st.integers(1, 6))
def test_groups_are_exactly_the_connected_prompts_and_their_common_prefix(seed, families, members, minimum):
    """Brute force: two prompts belong together when they share >= `minimum` leading tokens with each
    prompt keeping its last token (connectivity over pairs); each group's length is the common prefix of
    all its members, capped by the shortest member minus one."""
    prompts = _prompts_with_families(random.Random(seed), families, members)
    found = find_shared_prefixes(prompts, minimum)
    group_of = {m: g for g, prefix in enumerate(found) for m in prefix.members}
    assert len(group_of) == sum(len(p.members) for p in found)  # disjoint
    for prefix in found:
        assert len(prefix.members) > 1 and prefix.tokens >= minimum
        common = min(min(_common(prompts[a], prompts[b]) for a, b in itertools.combinations(prefix.members, 2)),
                     min(len(prompts[m]) - 1 for m in prefix.members))  # fmt: skip
        assert prefix.tokens == common
    for a, b in itertools.combinations(range(len(prompts)), 2):
        if min(_common(prompts[a], prompts[b]), len(prompts[a]) - 1, len(prompts[b]) - 1) >= minimum:
            assert a in group_of and group_of.get(a) == group_of.get(b), (prompts[a], prompts[b])


def test_no_prompts_and_distinct_prompts_share_nothing():
    assert find_shared_prefixes([]) == []
    assert find_shared_prefixes([[1] * 40, [2] * 40, [3] * 40]) == []


def test_saving_grows_with_the_shared_prefix_and_matches_the_cost_functions():
    costs = CostCoefficients()
    savings = []
    for tokens in (32, 128, 512):
        prefix = SharedPrefix(tuple(range(8)), tokens)
        savings.append(shared_prefix_saving_ms(prefix, [tokens + 16 + i for i in range(8)], GEOMETRY, costs))
    assert savings == sorted(savings) and savings[-1] > 0


def test_a_long_system_prompt_is_planned_shared_and_moves_auto_to_bucketed():
    """32 prompts = a 512-token system prompt + 16..64 user tokens: sharing pays; with the saving the
    route choice that picked ordinary picks bucketed."""
    rng = random.Random(3)
    system = [rng.randrange(1000) for _ in range(512)]
    prompts = [system + [rng.randrange(1000) for _ in range(rng.randint(16, 64))] for _ in range(32)]
    costs = CostCoefficients(fixed_ms=5.0, token_ms=0.01, attention_ms=1.0, kv_ms=0.01, decode_ms=10.0)
    shared = plan_shared_prefixes(prompts, GEOMETRY, costs)
    assert [(len(p.members), p.tokens) for p in shared] == [(32, 512)] and shared[0].saving_ms > 0
    lengths = [len(p) for p in prompts]
    plain = choose_route(lengths, 16, 32, GEOMETRY, costs)
    with_sharing = choose_route(lengths, 16, 32, GEOMETRY, costs, shared_saving_ms=shared[0].saving_ms)
    assert plain.route == ROUTE_ORDINARY  # without sharing, padded generate wins under these costs
    assert with_sharing.route == ROUTE_BUCKETED and with_sharing.bucketed_ms < plain.bucketed_lower_bound_ms
