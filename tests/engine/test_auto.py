"""The auto route: exact tokens (oracle: single-request model.generate), the decisions the cost model
should make for chosen coefficients, replanning on every refill admission, and planning overhead."""

from __future__ import annotations

import pytest
from oracles import assert_matches_oracle, oracle_batch
from workloads import ARCHS, choose_firing_eos, random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients

pytestmark = pytest.mark.usefixtures("single_thread")

# CPU-like coefficients: a small fixed cost per forward and expensive padding, so mixed lengths split
# into buckets while uniform short batches stay on ordinary generation (CB pays decode_ms per step).
CPU_LIKE = CostCoefficients(fixed_ms=6.0, token_ms=0.05, attention_ms=0.5, kv_ms=0.02, decode_ms=1.0)
# GPU-like coefficients (the reference's regime): a forward costs far more than a padded token, so
# the short workloads (640 padded tokens) stay ordinary while 128/4 and 512/16 split in two.
GPU_LIKE = CostCoefficients(fixed_ms=25.0, token_ms=0.01, attention_ms=0.0, kv_ms=0.0, decode_ms=2.0)
WORKLOADS = {
    "short similar": list(range(20, 12, -1)) * 4,
    "long tail": [512] + [16] * 31,
    "short tail": [20] + [1] * 31,
    "moderate tail": [128] + [4] * 31,
    "spread": list(range(16, 513, 16)),
}


def auto(model, costs=CPU_LIKE, **config):
    return Rollout(model, config=RolloutConfig(route="auto", costs=costs, **config))


@pytest.mark.engine
@pytest.mark.parametrize("arch", ARCHS)
def test_auto_matches_oracle_with_refill_and_eos(tiny_models, arch):
    model = tiny_models(arch)
    prompts = random_prompts([37, 3, 12, 64, 5, 9, 21, 2, 30, 7, 15, 44], seed=4)
    expected, _ = oracle_batch(model, prompts, 10, eos_token_id=[])
    eos = choose_firing_eos(expected)
    tokens, reasons = oracle_batch(model, prompts, 10, eos_token_id=eos)
    for batch_size in (12, 4):
        result = auto(model).generate(prompts, SamplingConfig(max_new_tokens=10, continuous_batch_size=batch_size,
                                                              eos_token_id=eos))
        assert_matches_oracle(result, tokens, reasons)
    assert "eos" in reasons and "length" in reasons


@pytest.mark.engine
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_auto_matches_oracle_on_reference_workloads(tiny_models, name):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(WORKLOADS[name], seed=1)
    tokens, reasons = oracle_batch(model, prompts, 6, repetition_penalty=1.3, eos_token_id=[])
    for batch_size in (32, 8):
        result = auto(model).generate(prompts, SamplingConfig(max_new_tokens=6, continuous_batch_size=batch_size,
                                                              repetition_penalty=1.3, eos_token_id=[]))
        assert_matches_oracle(result, tokens, reasons)


@pytest.mark.parametrize("name", ["long tail", "moderate tail"])
def test_auto_packs_the_tails_into_one_unpadded_forward(tiny_models, name):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(WORKLOADS[name], seed=2)
    sampling = SamplingConfig(max_new_tokens=4, continuous_batch_size=32, eos_token_id=[])
    result = auto(model, GPU_LIKE).generate(prompts, sampling)
    assert result.route == "bucketed" and result.profile.prefill_forms == [["packed"]]
    assert result.profile.prefill_forwards == 1 and result.profile.prefill_tokens == sum(WORKLOADS[name])
    padded = auto(model, GPU_LIKE, packing=False).generate(prompts, sampling)
    assert result.profile.estimated_bucketed_ms < padded.profile.estimated_bucketed_ms
    assert result.tokens == padded.tokens


@pytest.mark.parametrize(("name", "route", "forwards"), [
    ("short similar", "ordinary", 1),
    ("short tail", "ordinary", 1),
    ("long tail", "bucketed", 2),
    ("moderate tail", "bucketed", 2),
])
def test_auto_decisions_for_chosen_coefficients(tiny_models, name, route, forwards):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(WORKLOADS[name], seed=2)
    sampling = SamplingConfig(max_new_tokens=4, continuous_batch_size=32, eos_token_id=[])
    result = auto(model, GPU_LIKE, packing=False).generate(prompts, sampling)  # padded buckets only
    assert result.route == route, result.profile.decision_reason
    assert result.profile.prefill_forwards == forwards
    aligned = Rollout(model, config=RolloutConfig(route="aligned")).generate(prompts, sampling)
    assert aligned.profile.prefill_forwards == 32
    assert result.tokens == aligned.tokens
    if route == "bucketed":
        groups = result.profile.prefill_groups[0]
        assert sorted(len(g) for g in groups) == [1, 31] and groups[0] == [0]  # the long prompt alone
        assert result.profile.estimated_bucketed_ms < result.profile.estimated_ordinary_ms


def test_bucket_count_responds_to_fixed_cost(tiny_models):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(WORKLOADS["spread"], seed=3)
    sampling = SamplingConfig(max_new_tokens=2, continuous_batch_size=16, eos_token_id=[])  # ordinary ineligible
    # padded buckets only: with packing, one unpadded forward is cheapest for both (test_prefill_forms.py)
    cheap = auto(model, packing=False).generate(prompts, sampling)
    costly = auto(model, CostCoefficients(fixed_ms=5000.0, token_ms=0.05, attention_ms=0.5, kv_ms=0.02,
                                          decode_ms=1.0), packing=False).generate(prompts, sampling)
    assert all(len(groups) > 1 for groups in cheap.profile.prefill_groups)
    assert all(len(groups) == 1 for groups in costly.profile.prefill_groups)
    assert cheap.tokens == costly.tokens


def test_every_refill_admission_is_planned(tiny_models):
    model = tiny_models("tiny-llama")
    prompts = random_prompts([5 + (7 * i) % 60 for i in range(64)], seed=5)
    free_run, _ = oracle_batch(model, prompts[:8], 12, eos_token_id=[])
    eos = choose_firing_eos(free_run)
    sampling = SamplingConfig(max_new_tokens=12, continuous_batch_size=16, eos_token_id=eos)
    result = auto(model, packing=False).generate(prompts, sampling)  # padded buckets, so the DP splits
    admissions = result.profile.prefill_groups
    assert result.route == "bucketed" and len(admissions) > 4
    admitted = [index for groups in admissions for group in groups for index in group]
    assert sorted(admitted) == list(range(64)), "every prompt admitted exactly once"
    assert any(len(groups) > 1 for groups in admissions[1:]), "refills are bucketed by the DP too"
    assert "eos" in result.finish_reasons
    tokens, reasons = oracle_batch(model, prompts, 12, eos_token_id=eos)
    assert_matches_oracle(result, tokens, reasons)


def test_planning_time_is_part_of_total(tiny_models):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([1 + (i * 37) % 23 for i in range(1024)], seed=6)
    result = auto(model).generate(prompts, SamplingConfig(max_new_tokens=1, continuous_batch_size=256))
    profile = result.profile
    assert profile.plan_ms > 0
    assert profile.total_ms >= profile.plan_ms + profile.prefill_ms
    assert len(result.tokens) == 1024


def test_auto_respects_ineligibility_and_changes_no_configuration(tiny_models):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([8] * 4, seed=7)
    sampling = SamplingConfig(max_new_tokens=3)
    config = RolloutConfig(route="auto", costs=CPU_LIKE, trim_cache=True)
    result = Rollout(model, config=config).generate(prompts, sampling)
    assert result.route == "bucketed" and "trim_cache" in result.profile.decision_reason
    capped = auto(model, cache_capacity=64).generate(prompts, sampling)
    assert capped.route == "bucketed" and "cache_capacity" in capped.profile.decision_reason
    assert config.route == "auto" and config.trim_cache is True and sampling.continuous_batch_size == 32


def test_model_errors_propagate_without_retry(tiny_models, monkeypatch):
    model = tiny_models("tiny-qwen2")
    rollout = auto(model)
    prompts = random_prompts([40] + [4] * 7, seed=8)
    calls = []

    def failing_forward(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(model, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="boom"):
        rollout.generate(prompts, SamplingConfig(max_new_tokens=3))
    assert len(calls) == 1, "auto must not retry another route"
    monkeypatch.undo()
    assert len(rollout.generate(prompts, SamplingConfig(max_new_tokens=3)).tokens) == 8


@pytest.mark.engine
@pytest.mark.parametrize("arch", ARCHS)
def test_bucketed_route_matches_oracle_and_plans_every_admission(tiny_models, arch):
    """route="bucketed" is auto's CB branch without the route choice: the DP's buckets on every admission
    (first and refills), and no ordinary estimate is made."""
    from autobucket.costs.coefficients import ModelGeometry
    from autobucket.planning.planner import plan_prefill

    model = tiny_models(arch)
    prompts = random_prompts([40, 3, 12, 3, 5, 33, 21, 2, 30, 7], seed=6)
    free_run, _ = oracle_batch(model, prompts, 8, eos_token_id=[])
    eos = choose_firing_eos(free_run)
    tokens, reasons = oracle_batch(model, prompts, 8, eos_token_id=eos)
    rollout = Rollout(model, config=RolloutConfig(route="bucketed", costs=CPU_LIKE))
    result = rollout.generate(prompts, SamplingConfig(max_new_tokens=8, continuous_batch_size=4, eos_token_id=eos))
    assert_matches_oracle(result, tokens, reasons)
    assert result.route == "bucketed" and result.profile.estimated_ordinary_ms is None
    geometry = ModelGeometry.from_config(model.config, next(model.parameters()).dtype)
    for buckets in result.profile.prefill_groups:
        admitted = sorted(index for bucket in buckets for index in bucket)
        plan = plan_prefill([len(prompts[i]) for i in admitted], geometry, CPU_LIKE, 65536)
        assert sorted(sorted(b) for b in buckets) == sorted(sorted(admitted[i] for i in b) for b in plan.buckets)
