"""The compiled decode step (`RolloutConfig(compile=...)`) against the oracle, single-request
`model.generate`; weights updated in place between calls; errors raised in or under a compiled step
propagate unchanged while only compile failures fall back; the compile decision and its credit.

Compiling a decode graph takes tens of seconds on a CPU, so the engine tests here are built to need
exactly one graph (fixed rows, no EOS, short prompts: one row bucket, one column bucket). The whole
oracle suite with compile forced on is `make test-compile` (AUTOBUCKET_TEST_COMPILE=1)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch
from kernelized_models import kernelized_attention_model
from oracles import forget_oracle, hf_greedy, mismatches, oracle_batch
from workloads import random_prompts, steering_hook

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CB_STEP
from autobucket.engine.compiled import compiled_decode
from autobucket.engine.compiled.compile_setup import compile_credit_ms, compile_decision
from autobucket.engine.compiled.compiled_decode import (
    column_bucket,
    decode_graphs,
    predicted_graph_keys,
    row_bucket,
    store_columns,
)
from autobucket.engine.compiled.dynamo_compat import (
    LIFTED_GRAPH_LIMIT,
    dynamo_limit_name,
    lifted_graph_limit,
    raised_by_compiler,
)
from autobucket.engine.compiled.trace_local_variables import make_trace_local
from autobucket.models import build_tiny_model
from autobucket.planning.compile_choice import CompileCosts, choose_compile

LENGTHS = [7, 23, 12, 30]  # 4 rows, longest + budget < 128 columns: one graph
BUDGET = 8


def _sampling() -> SamplingConfig:
    return SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=len(LENGTHS), eos_token_id=[])


def _generate(model, compile_setting):
    return Rollout(model, config=RolloutConfig(route="aligned", compile=compile_setting, kernels="torch")).generate(
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

    def shifted(self, inputs, key):
        ids, positions, *rest = correct(self, inputs, key)
        return (ids, positions + 1, *rest)

    monkeypatch.setattr(compiled_decode.CompiledDecode, "_inputs", shifted)
    result = _generate(own_model, True)
    assert result.profile.compiled_steps == result.profile.decode_forwards
    assert len(mismatches(result.tokens, expected)) >= 2


@pytest.mark.engine
def test_control_the_compiled_step_of_a_llama_model_is_the_engines_step_on_its_graph_ops(monkeypatch):
    """A Llama-family model compiles the engine's step (`engine/decode/step.py`), not its forward: that
    step's graph ops with the queries left unrotated compile into every step and fail the oracle."""
    model = build_tiny_model("tiny-llama", seed=16)  # its own graphs
    expected, _ = oracle_batch(model, random_prompts(LENGTHS, seed=3), BUDGET, eos_token_id=[])
    graph_ops = compiled_decode.decode_ops

    def keys_only_rotated(*args):
        ops = graph_ops(*args)
        return dataclasses.replace(ops, rotary=lambda q, k, cos, sin: (q, ops.rotary(q, k, cos, sin)[1]))

    monkeypatch.setattr(compiled_decode, "decode_ops", keys_only_rotated)
    result = _generate(model, True)
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
    assert result.profile.eager_steps == result.profile.decode_forwards > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per model, not per call
        again = _generate(model, True)
    assert again.tokens == expected and again.profile.compile_fallback


@pytest.mark.engine
def test_auto_with_an_explicit_cache_capacity_reuses_the_graphs_it_compiled(own_model):
    """An explicit cache_capacity is kept exactly (140 columns, not rounded to 256): the auto decision's
    predicted keys must be the real ones, or it never sees its own graphs and gives no compile credit."""
    prompts, capacity = random_prompts(LENGTHS, seed=3), 140
    expected, _ = oracle_batch(own_model, prompts, BUDGET, eos_token_id=[])

    def decide(round_capacity: bool = False):
        return compile_decision(own_model, "auto", 4, 4, max(LENGTHS), BUDGET, capacity, round_capacity)

    before = decide()
    assert before.compile_ms > 0 and not before.compile_new and compile_credit_ms(before) == 0.0
    config = RolloutConfig(route="aligned", compile=True, cache_capacity=capacity, kernels="torch")
    first = Rollout(own_model, config=config).generate(prompts, _sampling())
    assert first.tokens == expected
    assert (first.profile.cache_capacity, first.profile.compiled_graphs) == (capacity, 1)

    after = decide()
    assert after.compile_ms == 0.0 and "already compiled" in after.reason
    assert compile_credit_ms(after) == after.saving_ms > 0
    assert decide(round_capacity=True).compile_ms > 0  # control: the old, rounded prediction misses it

    config = dataclasses.replace(config, compile="auto")
    second = Rollout(own_model, config=config).generate(prompts, _sampling())
    assert second.tokens == expected and "already compiled" in second.profile.compile_decision
    assert second.profile.compiled_steps == second.profile.decode_forwards > 0
    assert (second.profile.compiled_graphs, second.profile.eager_steps, second.profile.compile_ms) == (0, 0, 0.0)


@pytest.mark.engine
def test_a_model_that_raises_only_while_traced_falls_back_after_its_eager_step_succeeds():
    """The traced raise looks like a model error (dynamo's stand-in for it); the eager step then runs
    fine, so it was a tracing problem: the next step disables compiling, with one warning."""
    model = build_tiny_model("tiny-qwen2", seed=10)
    forward = model.forward

    @functools.wraps(forward)
    def compile_shy(*args, **kwargs):
        if torch.compiler.is_compiling():
            raise ModelError("refuses to be traced")
        return forward(*args, **kwargs)

    model.__dict__["forward"] = compile_shy
    expected, _ = oracle_batch(model, random_prompts(LENGTHS, seed=3), BUDGET, eos_token_id=[])
    with pytest.warns(RuntimeWarning, match="raised only while traced") as caught:
        result = _generate(model, True)
    assert len([w for w in caught if "decoding eagerly" in str(w.message)]) == 1
    assert result.tokens == expected
    assert result.profile.compiled_steps == 0 and result.profile.eager_steps == result.profile.decode_forwards
    assert "refuses to be traced" in result.profile.compile_fallback


@contextmanager
def another_thread_writes_during_the_compile(monkeypatch):
    """A write by another thread to process-wide state the trace read, pinned after dynamo built its
    guards and before it checks them on the same frame. The state written is the kernels hub's variable
    as the trace sees it (`TraceLocalVariable.traced_value`, read by the attention forward of
    transformers 5.x): the library's own variable was such state for other threads' eager forwards
    (`test_compile_other_threads.py`)."""
    layer = pytest.importorskip("kernels._internals.layer.layer")
    from torch._dynamo.guards import CheckFunctionManager

    make_trace_local()  # as the engine does before it compiles
    active = layer._ACTIVE_KERNEL_FUNCS
    built = CheckFunctionManager.compile_check_fn

    def then_the_other_thread_writes(self, *args, **kwargs):
        built(self, *args, **kwargs)
        active.traced_value = {}  # what a traced `set` stores (the model's own functions, keyed by id)

    monkeypatch.setattr(CheckFunctionManager, "compile_check_fn", then_the_other_thread_writes)
    try:
        yield
    finally:
        active.traced_value = None  # as a traced `reset` leaves it


@pytest.mark.engine
def test_a_compile_raced_by_another_threads_forward_falls_back_to_eager(monkeypatch):
    """Dynamo's "Guard failed on the same frame it was created" (a plain AssertionError from its own code)
    is a failure to compile: that step and the rest decode eagerly with one warning, tokens unchanged;
    the model's own asserts still propagate (`raised_by_compiler` looks at where it was raised)."""
    model = kernelized_attention_model(seed=12)  # its own graphs: the race disables them
    expected, _ = oracle_batch(model, random_prompts(LENGTHS, seed=3), BUDGET, eos_token_id=[])
    with another_thread_writes_during_the_compile(monkeypatch), pytest.warns(RuntimeWarning, match="eagerly"):
        result = _generate(model, True)
    assert result.tokens == expected
    assert result.profile.compiled_steps == 0 and result.profile.eager_steps == result.profile.decode_forwards
    assert "Guard failed on the same frame" in result.profile.compile_fallback


@pytest.mark.engine
def test_control_the_raced_compile_raises_out_of_generate_without_the_classifier(monkeypatch):
    model = kernelized_attention_model(seed=13)
    monkeypatch.setattr(compiled_decode, "raised_by_compiler", lambda error: False)
    with another_thread_writes_during_the_compile(monkeypatch), pytest.raises(AssertionError, match="Guard fail"):
        _generate(model, True)


def test_an_assert_outside_the_compiler_is_not_a_compile_failure():
    def model_code():
        assert False, "the model's own check"  # noqa: B011, PT015

    with pytest.raises(AssertionError) as caught:
        model_code()
    assert not raised_by_compiler(caught.value)
    assert not raised_by_compiler(ValueError("not an assert"))
    assert not raised_by_compiler(AssertionError("never raised: no traceback"))


HOOKED = {  # where a trainer's hook sits: a decoder layer (the model's forward runs), a linear (the engine's step)
    "layer": lambda model: model.model.layers[1],
    "linear": lambda model: model.model.layers[1].mlp.down_proj,
}


@pytest.mark.engine
@pytest.mark.parametrize("where", HOOKED)
def test_hooks_added_or_removed_after_compiling_are_followed(where):
    """Dynamo does not guard on module hooks: a graph compiled before a trainer adds a forward hook would
    skip it, and one compiled with it would keep running it after its removal. Each call's hooks select
    their own graphs (the hooked set compiled once, then reused; the plain graphs reused after removal),
    every call equal to HF generate with the same hooks."""
    model = build_tiny_model("tiny-llama", seed=11 if where == "layer" else 15)  # its own graphs
    prompts = random_prompts(LENGTHS, seed=3)
    plain, _ = oracle_batch(model, prompts, BUDGET, eos_token_id=[])
    rollout = Rollout(model, config=RolloutConfig(route="aligned", compile=True, kernels="torch"))
    sampling = _sampling()
    first = rollout.generate(prompts, sampling)
    assert first.tokens == plain and first.profile.compiled_graphs >= 1
    handle = HOOKED[where](model).register_forward_hook(steering_hook(model))
    try:
        hooked = hf_greedy(model, prompts, BUDGET)
        calls = [rollout.generate(prompts, sampling) for _ in range(2)]
    finally:
        handle.remove()
    assert hooked != plain, "the hook changed nothing: the test could not fail"
    assert [c.tokens for c in calls] == [hooked, hooked]
    assert calls[0].profile.compiled_graphs == first.profile.compiled_graphs  # the hooked set's own graphs
    assert calls[1].profile.compiled_graphs == 0 and calls[1].profile.compiled_steps > 0  # reused
    after = rollout.generate(prompts, sampling)
    assert after.tokens == plain and after.profile.compiled_graphs == 0 and after.profile.compiled_steps > 0
    assert (after.profile.recompiles, after.profile.compile_fallback) == (0, "")


@pytest.mark.engine
def test_control_without_the_hooks_key_a_compiled_graph_skips_a_new_hook(monkeypatch):
    # on a linear: the engine's step stays on (a hook on a module it skips would make the model's forward run)
    model = build_tiny_model("tiny-llama", seed=14)
    prompts = random_prompts(LENGTHS, seed=3)
    monkeypatch.setattr(compiled_decode, "hooks_epoch", lambda model: 0)
    rollout = Rollout(model, config=RolloutConfig(route="aligned", compile=True, kernels="torch"))
    rollout.generate(prompts, _sampling())
    handle = HOOKED["linear"](model).register_forward_hook(steering_hook(model))
    try:
        hooked = hf_greedy(model, prompts, BUDGET)
        result = rollout.generate(prompts, _sampling())
    finally:
        handle.remove()
    assert result.profile.compiled_steps > 0 and result.tokens != hooked


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


# ---- engine: errors propagate, only compile failures fall back -------------------------------------------


class ModelError(RuntimeError):
    """The user's own exception type."""


class Tripwire:
    """What the tripwire model raises, when, and whether the compiled step was running at that moment."""

    def __init__(self) -> None:
        self.raise_when_wide = False  # read at trace time: the forward raises once it attends > 128 columns
        self.fail_at: int | None = None  # run time: the decode forward (1-based) whose tripwire op raises
        self.calls = 0  # decode forwards seen by the op, eager or compiled
        self.in_compiled_step = False
        self.raised: BaseException | None = None
        self.raised_in_compiled_step: bool | None = None

    def reset(self) -> None:
        self.__init__()

    def fire(self, error: BaseException) -> BaseException:
        self.raised, self.raised_in_compiled_step = error, self.in_compiled_step
        return error


TRIPWIRE = Tripwire()


@torch.library.custom_op("autobucket_test::tripwire", mutates_args=())
def tripwire(ids: torch.Tensor) -> torch.Tensor:
    """Opaque to dynamo, so its body runs at run time inside the compiled graph (and in eager steps)."""
    TRIPWIRE.calls += 1
    if TRIPWIRE.calls == TRIPWIRE.fail_at:
        raise TRIPWIRE.fire(torch.OutOfMemoryError("tripwire: out of memory"))
    return ids.clone()


@tripwire.register_fake
def _(ids):
    return torch.empty_like(ids)


@pytest.fixture(scope="module")
def tripwire_model(monkeypatch_module):
    """A tiny model whose decode forwards pass the tripwire op, and which raises ModelError, when
    armed, from any decode forward attending over more than 128 columns; `_compiled_step` is wrapped
    to record whether a raise happened inside the compiled call."""
    model = build_tiny_model("tiny-llama", seed=13)
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature the engine inspects
    def guarded(*args, **kwargs):
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        if ids.shape[1] == 1:
            kwargs["input_ids"] = tripwire(ids)
            wide = mask is not None and mask.dim() == 4 and mask.shape[-1] > compiled_decode.COLUMN_STEP
            if wide and TRIPWIRE.raise_when_wide:  # short-circuit: narrow graphs never guard on the flag
                raise TRIPWIRE.fire(ModelError("a decode forward past 128 columns"))
        return forward(*args, **kwargs)

    model.__dict__["forward"] = guarded
    compiled_step = compiled_decode._compiled_step

    def recording_step():
        step = compiled_step()

        def run(*args):
            TRIPWIRE.in_compiled_step = True
            try:
                return step(*args)
            finally:
                TRIPWIRE.in_compiled_step = False

        return run

    monkeypatch_module.setattr(compiled_decode, "_compiled_step", recording_step)
    return model


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


TRIP_SAMPLING = SamplingConfig(max_new_tokens=4, continuous_batch_size=2, eos_token_id=[])
TRIP_CONFIG = RolloutConfig(route="aligned", compile=True, cache_capacity=256, kernels="torch")  # one capacity: shared graphs
SHORT = random_prompts([5, 9], seed=4)


def _good_call_is_compiled_and_exact(rollout, model) -> None:
    TRIPWIRE.reset()
    expected, _ = oracle_batch(model, SHORT, 4, eos_token_id=[])
    TRIPWIRE.reset()
    good = rollout.generate(SHORT, TRIP_SAMPLING)
    assert good.tokens == expected
    assert good.profile.compiled_steps == good.profile.decode_forwards == 3 and not good.profile.compile_fallback


@pytest.mark.engine
def test_a_model_error_on_the_third_decode_forward_propagates_and_the_rollout_stays_usable(tripwire_model):
    """The model raises ModelError on its third decode forward: prompts of 126 and 5 tokens put the
    third step at column 128, the first step past one column bucket, so it is a new graph and dynamo
    traces the forward's `raise` then. Measured (torch 2.13, fullgraph=True): dynamo does not raise
    the user's exception but `Unsupported("Observed exception")` caused by a stand-in
    `ObservedModelErrorError` — its code never ran. The engine runs that step eagerly, where the
    forward raises the real ModelError object, which must leave `generate` unchanged; compiled decoding
    stays on for the model (it was the model's error, not a compile failure)."""
    rollout = Rollout(tripwire_model, config=TRIP_CONFIG)
    TRIPWIRE.reset()
    TRIPWIRE.raise_when_wide = True
    with pytest.raises(ModelError) as caught:
        rollout.generate(random_prompts([126, 5], seed=4), TRIP_SAMPLING)
    assert caught.value is TRIPWIRE.raised and TRIPWIRE.calls == 3  # the third decode forward's own object
    assert TRIPWIRE.raised_in_compiled_step is False  # dynamo could not run the raise: the eager step did
    assert decode_graphs(tripwire_model).disabled_reason == ""
    _good_call_is_compiled_and_exact(rollout, tripwire_model)


@pytest.mark.engine
def test_out_of_memory_inside_the_third_compiled_step_propagates_as_itself(tripwire_model):
    """A `torch.OutOfMemoryError` raised at run time inside the compiled graph (by the tripwire, a
    custom op dynamo cannot look into, so its body runs inside the compiled call as an allocation
    would) leaves `generate` as the same object; no eager retry swallows it."""
    rollout = Rollout(tripwire_model, config=TRIP_CONFIG)
    TRIPWIRE.reset()
    TRIPWIRE.fail_at = 3
    with pytest.raises(torch.OutOfMemoryError) as caught:
        rollout.generate(SHORT, TRIP_SAMPLING)
    assert caught.value is TRIPWIRE.raised and TRIPWIRE.raised_in_compiled_step is True
    assert decode_graphs(tripwire_model).disabled_reason == ""
    _good_call_is_compiled_and_exact(rollout, tripwire_model)


# ---- pure: buckets, the decision, the config -----------------------------------------------------------


def test_row_and_column_buckets():
    assert [row_bucket(r, 24) for r in (1, 2, 3, 5, 9, 17, 24)] == [1, 2, 4, 8, 16, 24, 24]
    assert [column_bucket(c, 384) for c in (1, 128, 129, 300, 384)] == [128, 128, 256, 384, 384]
    assert predicted_graph_keys(32, 512, 16, store_columns(528, True)) == {(32, 640, 640, 0)}
    assert predicted_graph_keys(4, 100, 64, store_columns(164, True)) == {(4, 128, 256, 0), (4, 256, 256, 0)}
    # an explicit cache_capacity is kept exactly, in the store and in the prediction
    assert store_columns(140, False) == 140
    assert predicted_graph_keys(4, 30, 8, 140) == {(4, 128, 140, 0)}
    assert predicted_graph_keys(4, 100, 64, 164) == {(4, 128, 164, 0), (4, 164, 164, 0)}


def test_the_dynamo_graph_limit_is_set_under_the_name_this_torch_has():
    assert dynamo_limit_name(SimpleNamespace(recompile_limit=8, cache_size_limit=8)) == "recompile_limit"
    assert dynamo_limit_name(SimpleNamespace(cache_size_limit=8)) == "cache_size_limit"  # torch < 2.7
    assert dynamo_limit_name(SimpleNamespace()) is None
    patched = []
    old_torch = SimpleNamespace(cache_size_limit=8, patch=lambda **names: patched.append(names) or nullcontext())
    with lifted_graph_limit(old_torch):
        pass
    assert patched == [{"cache_size_limit": LIFTED_GRAPH_LIMIT}]
    with lifted_graph_limit(SimpleNamespace()):  # neither name: nothing to patch, nothing raised
        pass
    name = dynamo_limit_name(torch._dynamo.config)  # this torch (the pyproject floor is the tested one)
    before = getattr(torch._dynamo.config, name)
    with lifted_graph_limit():
        assert getattr(torch._dynamo.config, name) == LIFTED_GRAPH_LIMIT != before
    assert getattr(torch._dynamo.config, name) == before


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
    from autobucket.engine.compiled.compile_setup import compile_credit_ms
    from autobucket.planning.compile_choice import CompileDecision

    assert compile_credit_ms(CompileDecision(False, False, 500.0, 0.0, "")) == 0.0
    assert compile_credit_ms(CompileDecision(True, False, 500.0, 0.0, "")) == 500.0  # all shapes compiled
    assert compile_credit_ms(CompileDecision(True, False, 500.0, 900.0, "")) == 0.0  # new shapes run eagerly
    assert compile_credit_ms(CompileDecision(True, True, 5000.0, 900.0, "")) == 4100.0


def test_compile_is_off_by_default_and_make_test_compile_switches_only_the_default(forced_compile):
    assert RolloutConfig().compile is forced_compile  # False, or True under AUTOBUCKET_TEST_COMPILE=1
    assert RolloutConfig(compile=False).compile is False
