"""Decode figures measured on the device (`costs.decode_figures`): medians of what was recorded, kept
per device / geometry / dtype / kernel set, bad figures refused whole; on a real tiny model, `compile="auto"`
probes the eager step once per key and row count, decides on the measurements by the formula, says so in
the profile, learns from the steps every call runs anyway, and leaves the call's tokens as they were."""

from __future__ import annotations

import copy
import math
import re
import statistics

import pytest
import torch
from oracles import oracle_batch
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CB_STEP
from autobucket.costs.decode_figures import (
    EAGER,
    PROBE_STEPS,
    CompileFigures,
    DecodeFigures,
    figures_key,
    steps_form,
)
from autobucket.engine.compiled.compile_setup import compile_decision
from autobucket.models import build_tiny_model
from autobucket.planning.compile_choice import choose_compile
from autobucket.profile import Profile, Timing

pytestmark = pytest.mark.usefixtures("single_thread")

LENGTHS = [5, 9, 14, 7]  # 4 rows, short: one decode shape, never compiled here
BUDGET = 6


@pytest.fixture(scope="module")
def key(tiny_models):
    return figures_key(tiny_models("tiny-llama"), "torch")


def test_figures_are_the_medians_of_what_was_recorded(key):
    store = DecodeFigures()
    eager, compiled = [4.0, 5.0, 9.0], [1.0, 2.0, 1.5, 3.0]
    store.record_steps(key, EAGER, 8, eager)
    store.record_steps(key, "compiled", 8, compiled)
    store.record_steps(key, EAGER, 2, [2.0])
    store.record_steps(key, "compiled", 2, [1.5])
    store.record_graphs(key, "compiled", [30.0, 10.0])
    at_eight = store.figures(key, 8)
    assert (at_eight.device, at_eight.rows, at_eight.eager_step_ms, at_eight.eager_steps) == (key.device, 8, 5.0, 3)
    form = at_eight.forms["compiled"]
    assert (form.graph_ms, form.graphs, form.step_fraction, form.steps) == (20.0, 2, statistics.median(compiled) / 5.0, 4)
    at_four = store.figures(key, 4)  # nothing at 4 rows: no eager step; the fraction over the row counts measured
    assert at_four.eager_step_ms is None and at_four.eager_steps == 0
    assert at_four.forms["compiled"].step_fraction == pytest.approx(statistics.median([1.75 / 5.0, 1.5 / 2.0]))
    assert DecodeFigures().figures(key, 8).forms == {}  # control: another store holds none of it


def test_figures_are_kept_per_device_geometry_dtype_and_kernel_set(tiny_models, key):
    store = DecodeFigures()
    store.record_steps(key, EAGER, 4, [3.0])
    llama = tiny_models("tiny-llama")
    assert figures_key(build_tiny_model("tiny-llama", seed=11), "torch") == key  # geometry, not weights
    others = {
        "geometry": figures_key(tiny_models("tiny-qwen2"), "torch"),
        "dtype": figures_key(copy.deepcopy(llama).to(torch.bfloat16), "torch"),
        "kernels": figures_key(llama, "invariant"),
    }
    for what, other in others.items():
        assert other != key, what
        assert store.figures(other, 4).eager_step_ms is None and not store.has_eager_step(other, 4), what
    assert store.figures(key, 4).eager_step_ms == 3.0


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf])
def test_bad_recordings_are_refused_whole(key, bad):
    store = DecodeFigures()
    with pytest.raises(ValueError, match="step_ms="):
        store.record_steps(key, EAGER, 4, [1.0, bad])
    with pytest.raises(ValueError, match="graph_ms="):
        store.record_graphs(key, "compiled", [bad])
    with pytest.raises(ValueError, match="rows="):
        store.record_steps(key, EAGER, 0, [1.0])
    assert not store.has_eager_step(key, 4) and store.figures(key, 4).forms == {}  # nothing half-recorded
    store.record_steps(key, EAGER, 4, [1.0])  # the store is usable afterwards
    assert store.figures(key, 4).eager_step_ms == 1.0


def _profile(compiled_steps: int, eager_steps: int, steps: list[tuple[int, float]], **counters) -> Profile:
    profile = Profile(compiled_steps=compiled_steps, eager_steps=eager_steps, **counters)
    profile.timings = [Timing(CB_STEP, rows, 10, ms) for rows, ms in steps] + [Timing("prefill_forward", 4, 16, 99.0)]
    return profile


def test_a_call_teaches_the_form_its_steps_ran_in_and_its_compile_durations(key):
    store = DecodeFigures()
    store.record_call(key, _profile(0, 0, [(4, 2.0), (4, 4.0), (3, 1.0)]))  # compiling off: eager
    store.record_call(key, _profile(6, 0, [(4, 1.0), (4, 1.0)], compiled_graphs=2, recompiles=1, compile_ms=900.0))
    store.record_call(key, _profile(3, 3, [(4, 50.0)] * 6))  # a mix: which step was which is unknown
    figures = store.figures(key, 4)
    assert (figures.eager_step_ms, figures.eager_steps) == (3.0, 2)
    compiled = figures.forms["compiled"]
    assert (compiled.step_fraction, compiled.steps, compiled.graph_ms, compiled.graphs) == (1.0 / 3.0, 2, 300.0, 3)
    assert [steps_form(_profile(c, e, [])) for c, e in ((0, 5), (5, 0), (2, 3))] == [EAGER, "compiled", None]


def _auto_rollout(model, store: DecodeFigures) -> Rollout:
    rollout = Rollout(model, config=RolloutConfig(route="aligned", compile="auto", kernels="torch"))
    rollout.decode_figures = store
    return rollout


def _sampling() -> SamplingConfig:
    return SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=len(LENGTHS), eos_token_id=[])


@pytest.mark.engine
def test_auto_probes_the_eager_step_once_then_learns_from_the_calls_steps(tiny_models, key):
    model, store = tiny_models("tiny-llama"), DecodeFigures()
    prompts = random_prompts(LENGTHS, seed=4)
    expected, _ = oracle_batch(model, prompts, BUDGET, eos_token_id=[])
    rollout = _auto_rollout(model, store)
    first = rollout.generate(prompts, _sampling())
    assert first.tokens == expected  # the probe and the decision leave the call's tokens as they were
    rows = len(LENGTHS)
    assert re.search(rf"\[eager step [\d.e+]+ ms measured on cpu at {rows} rows \({PROBE_STEPS} steps\)", first.profile.compile_decision)
    assert "compiled: 30000 ms a graph prior" in first.profile.compile_decision  # nothing compiled yet
    steps = [t for t in first.profile.timings if t.kind == CB_STEP and t.rows == rows]
    assert steps and store.figures(key, rows).eager_steps == PROBE_STEPS + len(steps)  # the call's own steps joined

    second = rollout.generate(prompts, _sampling())  # measured already: no second probe
    more = [t for t in second.profile.timings if t.kind == CB_STEP and t.rows == rows]
    assert second.tokens == expected
    assert store.figures(key, rows).eager_steps == PROBE_STEPS + len(steps) + len(more)
    assert f"measured on cpu at {rows} rows ({PROBE_STEPS + len(steps)} steps)" in second.profile.compile_decision


@pytest.mark.engine
def test_a_second_geometry_probes_its_own_eager_step(tiny_models, key):
    store = DecodeFigures()
    _auto_rollout(tiny_models("tiny-llama"), store).generate(random_prompts(LENGTHS, seed=4), _sampling())
    qwen = tiny_models("tiny-qwen2")
    result = _auto_rollout(qwen, store).generate(random_prompts(LENGTHS, seed=4), _sampling())
    qwen_key = figures_key(qwen, "torch")
    qwen_steps = [t for t in result.profile.timings if t.kind == CB_STEP and t.rows == len(LENGTHS)]
    assert store.figures(qwen_key, len(LENGTHS)).eager_steps == PROBE_STEPS + len(qwen_steps)  # probed anew
    assert f"({PROBE_STEPS} steps)" in result.profile.compile_decision


@pytest.mark.engine
def test_the_decision_on_real_measurements_flips_with_the_measured_compile_by_the_formula(tiny_models, key):
    """The eager step measured on the tiny model (its probe and a call's steps); a compile duration
    recorded either side of what a long call's predicted saving repays: the decision follows the formula
    on the recorded figures, and measures nothing more."""
    model, store, rows, budget = tiny_models("tiny-llama"), DecodeFigures(), len(LENGTHS), 200
    _auto_rollout(model, store).generate(random_prompts(LENGTHS, seed=4), _sampling())
    figures = CompileFigures(store, key)  # no probe: what was measured is all there is
    decide = lambda: compile_decision(model, "auto", rows, rows, 10, budget, 10 + budget, figures=figures)  # noqa: E731
    prior = compile_decision(model, "auto", rows, rows, 10, budget, 10 + budget)
    assert "measured" not in prior.reason  # without figures: the prior
    first, measured = decide(), store.figures(key, rows)
    new_graphs = round(prior.compile_ms / 30_000.0)
    parameters = sum(p.numel() for p in model.parameters())
    assert first == choose_compile("auto", parameters, rows, budget - 1, new_graphs, measured=measured)
    saving = (budget - 1) * measured.eager_step_ms * (1 - 0.85)
    assert first.saving_ms == pytest.approx(saving) and not first.compile_new
    store.record_graphs(key, "compiled", [saving / new_graphs / 2])  # a compile this short repays ...
    assert decide().compile_new
    store.record_graphs(key, "compiled", [saving * 4 / new_graphs] * 2)  # ... its median now 4x: it does not
    assert not decide().compile_new
    assert store.figures(key, rows).eager_steps == measured.eager_steps  # nothing more was measured
