"""The runner the routes build on: `DecodeRows` keeps each row's fields together through appends,
steps and retirements; the online probe runs the engine's routes under the user's own config, with no
nested `Rollout`; the compile decision is made once per call."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.engine import routes
from autobucket.engine.batching.decode_rows import DecodeRows
from autobucket.engine.rollout import Rollout as RolloutClass
from autobucket.models import build_tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")


def test_decode_rows_keep_every_field_of_a_row_together():
    rows = DecodeRows.empty(torch.device("cpu"), vocab_size=8, track_seen=True)
    seen = torch.zeros((3, 8), dtype=torch.bool)
    seen[0, 1] = seen[1, 2] = seen[2, 3] = True
    rows.append(torch.tensor([5, 6, 7]), torch.tensor([10, 20, 30]), seen)
    rows.advance(torch.tensor([1, 4, 0]))
    rows.keep(torch.tensor([2, 0]))
    # Row order is now (old row 2, old row 0): each field followed its row.
    assert rows.tokens.tolist() == [0, 1]
    assert rows.positions.tolist() == [31, 11]
    assert rows.seen[0].nonzero().flatten().tolist() == [0, 3]
    assert rows.seen[1].nonzero().flatten().tolist() == [1]
    assert rows.count == 2


def test_decode_rows_without_a_penalty_track_no_seen_ids():
    rows = DecodeRows.empty(torch.device("cpu"), vocab_size=8, track_seen=False)
    rows.append(torch.tensor([1]), torch.tensor([4]), None)
    rows.advance(torch.tensor([2]))
    assert rows.seen is None and rows.tokens.tolist() == [2] and rows.positions.tolist() == [5]


def test_the_online_probe_runs_the_routes_under_the_users_config_without_nested_rollouts(monkeypatch):
    model = build_tiny_model("tiny-qwen2", seed=41)
    # persist_costs=False: no stored entry from an earlier test can stand in for the probe
    config = RolloutConfig(route="auto", packing=False, prefill_max_tokens=48, trim_cache=True, persist_costs=False)
    rollout = Rollout(model, config=config)
    seen_configs, constructed = [], []
    original_route, original_init = RolloutClass._run_route, RolloutClass.__init__

    def spy_route(self, run_config, *args, **kwargs):
        seen_configs.append(run_config)
        return original_route(self, run_config, *args, **kwargs)

    def spy_init(self, *args, **kwargs):
        constructed.append(args)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(RolloutClass, "_run_route", spy_route)
    monkeypatch.setattr(RolloutClass, "__init__", spy_init)
    rollout.generate(random_prompts([6, 9], seed=1), SamplingConfig(max_new_tokens=3))
    assert not constructed, "the probe built nested Rollouts"
    probe = seen_configs[:-1]
    assert len(probe) >= 3 and {c.route for c in probe} >= {"ordinary", "aligned"}
    assert all(c.packing is False and c.prefill_max_tokens == 48 and c.trim_cache for c in probe)
    assert all(c.costs == CostCoefficients() and c.compile is False for c in probe)
    # the routes see the user's config with "auto" kernels resolved to the set that runs, never "auto"
    ran = rollout.kernel_choice.kernels
    assert ran in ("invariant", "hf") and seen_configs[-1] == dataclasses.replace(config, kernels=ran)
    assert {c.kernels for c in seen_configs} == {ran}


def test_the_compile_decision_is_made_once_per_call(monkeypatch):
    model = build_tiny_model("tiny-llama", seed=42)
    decisions = []
    original = routes._compile_decision_for

    def counting(call, shape):
        decisions.append(call.config.route)
        return original(call, shape)

    monkeypatch.setattr(routes, "_compile_decision_for", counting)
    rollout = Rollout(model, config=RolloutConfig(route="auto", costs=CostCoefficients(), compile="auto"))
    rollout.generate(random_prompts([5, 30, 12], seed=2), SamplingConfig(max_new_tokens=3))
    assert decisions == ["auto"]
    Rollout(model, config=RolloutConfig(route="ordinary")).generate(random_prompts([5], seed=2), SamplingConfig(max_new_tokens=2))
    assert decisions == ["auto"]  # ordinary generate is never compiled: no decision
