"""The compiled decode step (`RolloutConfig(compile=...)`) against the oracle, single-request
`model.generate`; weights updated in place between calls; the fallback; the compile decision.

Compiling a decode graph takes tens of seconds on a CPU, so the engine tests here are built to need
exactly one graph (fixed rows, no EOS, short prompts: one row bucket, one column bucket). The whole
oracle suite with compile forced on is `make test-compile` (AUTOBUCKET_TEST_COMPILE=1)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from conftest import forget_oracle, mismatches, oracle_batch, random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine import compiled_decode
from autobucket.engine.compiled_decode import column_bucket, predicted_graph_keys, row_bucket
from autobucket.models import build_tiny_model
from autobucket.planning.compile_choice import CompileCosts, choose_compile
from autobucket.planning.costs import CB_STEP

LENGTHS = [7, 23, 12, 30]  # 4 rows, longest + budget < 128 columns: one graph
BUDGET = 8


def _sampling() -> SamplingConfig:
    return SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=len(LENGTHS), eos_token_id=[])


def _generate(model, compile_setting):
    return Rollout(model, config=RolloutConfig(route="aligned", compile=compile_setting)).generate(
        random_prompts(LENGTHS, seed=3), _sampling()
    )


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def own_model():
    """A model of this module only: its compiled graphs and weight updates touch no other test."""
    return build_tiny_model("tiny-llama", seed=7)


# ---- engine: one compiled graph ------------------------------------------------------------------------


@pytest.mark.engine
def test_compiled_decode_matches_generate_then_follows_an_in_place_optimizer_step(own_model):
    prompts = random_prompts(LENGTHS, seed=3)
    before, _ = oracle_batch(own_model, prompts, BUDGET, eos_token_id=[])
    first = _generate(own_model, True)
    assert first.tokens == before
    profile = first.profile
    if profile.compile_fallback:
        pytest.fail(f"compiled decode fell back to eager: {profile.compile_fallback}")
    assert profile.compiled_graphs == 1 and profile.compiled_steps == profile.decode_forwards > 0
    assert profile.compile_ms > 0
    # The compiling step's time is compile time: kept out of the step timings the cost model learns from.
    assert len([t for t in profile.timings if t.kind == CB_STEP]) == profile.decode_forwards - 1

    # An RL step: the optimizer updates the parameters in place.
    optimizer = torch.optim.SGD(own_model.parameters(), lr=0.5)
    ids = torch.tensor([prompts[3]])
    own_model(input_ids=ids).logits[0, -1, before[3][0]].backward()  # push the first token's logit
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    forget_oracle(own_model)  # the oracle's answers were for the old weights
    after, _ = oracle_batch(own_model, prompts, BUDGET, eos_token_id=[])
    assert after != before, "the update should change greedy tokens, or this test proves nothing"

    second = _generate(own_model, True)
    assert second.tokens == after  # the new weights' tokens ...
    assert second.profile.compiled_steps == second.profile.decode_forwards
    assert (second.profile.compiled_graphs, second.profile.recompiles, second.profile.compile_ms) == (0, 0, 0.0)

    # "auto" reuses the compiled graph without being asked to compile.
    third = _generate(own_model, "auto")
    assert third.tokens == after and third.profile.compiled_steps == third.profile.decode_forwards


@pytest.mark.engine
def test_control_compiled_step_with_wrong_positions_fails_the_oracle(own_model, monkeypatch):
    prompts = random_prompts(LENGTHS, seed=3)
    expected, _ = oracle_batch(own_model, prompts, BUDGET, eos_token_id=[])
    correct = compiled_decode.CompiledDecode._inputs

    def shifted(self, runner, key):
        ids, positions, *rest = correct(self, runner, key)
        return (ids, positions + 1, *rest)

    monkeypatch.setattr(compiled_decode.CompiledDecode, "_inputs", shifted)
    result = _generate(own_model, True)
    assert result.profile.compiled_steps == result.profile.decode_forwards
    assert len(mismatches(result.tokens, expected)) >= 2


@pytest.mark.engine
def test_a_model_that_does_not_trace_falls_back_to_eager_with_a_warning_and_the_reason():
    model = build_tiny_model("tiny-qwen2", seed=9)
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature the engine inspects
    def untraceable(*args, **kwargs):
        torch._dynamo.graph_break()  # under fullgraph=True this is a compile error
        return forward(*args, **kwargs)

    model.__dict__["forward"] = untraceable
    expected, _ = oracle_batch(model, random_prompts(LENGTHS, seed=3), BUDGET, eos_token_id=[])
    with pytest.warns(RuntimeWarning, match="decoding eagerly"):
        result = _generate(model, True)
    assert result.tokens == expected
    assert result.profile.compiled_steps == 0 and "graph_break" in result.profile.compile_fallback.lower()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per model, not per call
        again = _generate(model, True)
    assert again.tokens == expected and again.profile.compile_fallback


@pytest.mark.engine
def test_a_recompile_storm_is_counted_then_stops_compiled_decoding(own_model, monkeypatch):
    """Every step of an already compiled shape reported as a fresh dynamo graph (a guard that keeps
    failing) is counted; past the limit the model decodes eagerly with a warning. Runs last on
    own_model: it disables its compiled path."""
    counter = iter(range(0, 10**6, 1))
    monkeypatch.setattr(compiled_decode, "_graph_count", lambda: next(counter))
    expected, _ = oracle_batch(own_model, random_prompts(LENGTHS, seed=3), BUDGET, eos_token_id=[])
    with pytest.warns(RuntimeWarning, match="recompile storm"):
        result = _generate(own_model, True)
    assert result.tokens == expected
    profile = result.profile
    assert profile.recompiles == compiled_decode.MAX_RECOMPILES_PER_MODEL + 1
    assert profile.compiled_steps == profile.recompiles + profile.compiled_graphs
    assert "recompile storm" in profile.compile_fallback
    assert profile.decode_forwards > profile.compiled_steps  # the rest ran eagerly


# ---- pure: buckets, the decision, the config -----------------------------------------------------------


def test_row_and_column_buckets():
    assert [row_bucket(r, 24) for r in (1, 2, 3, 5, 9, 17, 24)] == [1, 2, 4, 8, 16, 24, 24]
    assert [column_bucket(c, 384) for c in (1, 128, 129, 300, 384)] == [128, 128, 256, 384, 384]
    assert predicted_graph_keys(32, 512, 16, 528) == {(32, 640, 640)}
    assert predicted_graph_keys(4, 100, 64, 164) == {(4, 128, 256), (4, 256, 256)}


def test_auto_compiles_only_when_the_saving_repays_new_graphs():
    costs = CompileCosts(graph_compile_ms=10_000.0, step_fixed_ms=0.0, step_ms_per_gflop=50.0, compiled_fraction=0.5)
    # 20M parameters x 32 rows = 1.28 GFLOP per step -> 64 ms eager, 32 ms saved per step
    short = choose_compile("auto", 20_000_000, 32, 100, new_graphs=1, costs=costs)
    long = choose_compile("auto", 20_000_000, 32, 1000, new_graphs=1, costs=costs)
    warm = choose_compile("auto", 20_000_000, 32, 1, new_graphs=0, costs=costs)
    assert (short.use_compiled, short.compile_new) == (True, False)
    assert (long.use_compiled, long.compile_new) == (True, True)
    assert (warm.use_compiled, warm.compile_new) == (True, False) and "already compiled" in warm.reason
    assert short.saving_ms == pytest.approx(3200.0) and long.compile_ms == 10_000.0
    assert choose_compile(True, 1, 1, 1, 5).compile_new
    assert not choose_compile(False, 10**9, 64, 10**6, 0).use_compiled


@pytest.mark.parametrize("bad", ["yes", 1, 0, None, "True"])
def test_compile_setting_is_validated(bad):
    with pytest.raises(ValueError, match="compile="):
        RolloutConfig(compile=bad)
    with pytest.raises(ValueError, match="compile="):
        choose_compile(bad, 1, 1, 1, 1)


@pytest.mark.engine
def test_auto_does_not_compile_a_new_shape_for_a_small_call():
    model = build_tiny_model("tiny-gpt2", seed=5)
    expected, _ = oracle_batch(model, random_prompts(LENGTHS, seed=3), BUDGET, eos_token_id=[])
    result = _generate(model, "auto")
    assert result.tokens == expected
    assert (result.profile.compiled_steps, result.profile.compiled_graphs, result.profile.compile_ms) == (0, 0, 0.0)
    assert "reuse compiled shapes only" in result.profile.compile_decision


def test_compile_credit_counts_compile_time_only_for_new_graphs():
    from autobucket.engine.compile_setup import compile_credit_ms
    from autobucket.planning.compile_choice import CompileDecision

    assert compile_credit_ms(CompileDecision(False, False, 500.0, 0.0, "")) == 0.0
    assert compile_credit_ms(CompileDecision(True, False, 500.0, 0.0, "")) == 500.0  # all shapes compiled
    assert compile_credit_ms(CompileDecision(True, False, 500.0, 900.0, "")) == 0.0  # new shapes run eagerly
    assert compile_credit_ms(CompileDecision(True, True, 5000.0, 900.0, "")) == 4100.0


def test_compile_is_off_by_default_and_make_test_compile_switches_only_the_default(forced_compile):
    assert RolloutConfig().compile is forced_compile  # False, or True under AUTOBUCKET_TEST_COMPILE=1
    assert RolloutConfig(compile=False).compile is False
