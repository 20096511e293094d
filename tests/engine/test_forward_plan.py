"""The forward plan: what `kernels=` and `op_backends=` make each op family run, reported on the profile.

Oracles: single-request HF `generate` for kernels="torch" (the model's own ops everywhere), counters on
the engine's kernels (none may run under "torch"; each runs where the plan names "cpu"); negative
control: the old default's decode kernel, asked for by op, runs where "torch" runs none."""

from __future__ import annotations

import threading

import pytest
from oracles import hf_greedy
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.cli.generate import plan_line
from autobucket.costs.coefficients import CostCoefficients
from autobucket.engine.intercept.active import ActiveForward, active
from autobucket.engine.kernels import invariant_attention
from autobucket.engine.kernels.elementwise import rms_norm, rotary
from autobucket.engine.plan.ops import OPS

PROMPTS = random_prompts((6, 15, 9), seed=11)
NEW_TOKENS = 5
ELEMENTWISE = ("rotary", "gated_mlp", "rms_norm")


def run(model, **config):
    rollout = Rollout(model, config=RolloutConfig(route="bucketed", compile=False, costs=CostCoefficients(), **config))
    return rollout.generate(PROMPTS, SamplingConfig(max_new_tokens=NEW_TOKENS, logprobs=True, eos_token_id=[]))


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts of the engine's C++ kernels a call ran: the fused rotary and RMSNorm, and attention."""
    calls = {"rotary": 0, "rms_norm": 0, "attention": 0}

    def counted(module, name, key):
        inner = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(rotary, "fused_rotary_embedding", "rotary")
    counted(rms_norm, "rms_norm", "rms_norm")
    counted(invariant_attention, "invariant_attention", "attention")
    return calls


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_torch_runs_the_models_own_ops_and_equals_generate(tiny_models, name, kernel_calls):
    model = tiny_models(name)
    result = run(model, kernels="torch")
    assert kernel_calls == {"rotary": 0, "rms_norm": 0, "attention": 0}
    plan = result.profile.plan
    assert {op: plan[op] for op in OPS if op not in ("shared_prefix_attention", "logprobs")} == dict.fromkeys(
        [op for op in OPS if op not in ("shared_prefix_attention", "logprobs")], "torch"
    )
    assert plan["decode_step"] in ("engine", "model") and set(plan["reasons"]) == {*OPS, "decode_step"}
    assert result.tokens == hf_greedy(model, PROMPTS, NEW_TOKENS)


def test_asking_for_the_kernels_by_op_runs_them(tiny_models, kernel_calls):
    """Negative control for the test above: the ops the old default ran on the engine's kernels, asked
    for by name, do run there (so zero counts under "torch" mean something), with the same tokens."""
    model = tiny_models("tiny-llama")
    asked = {**dict.fromkeys(ELEMENTWISE, "cpu"), "decode_attention": "cpu"}
    result = run(model, kernels="torch", op_backends=asked)
    assert kernel_calls["rotary"] > 0 and kernel_calls["rms_norm"] > 0 and kernel_calls["attention"] > 0
    assert all(result.profile.plan[op] == "cpu" for op in asked)
    assert result.tokens == hf_greedy(model, PROMPTS, NEW_TOKENS)


def test_hf_is_the_deprecated_spelling_of_torch(tiny_models):
    model = tiny_models("tiny-llama")
    with pytest.warns(DeprecationWarning, match=r"kernels='hf'\) is deprecated: it means kernels='torch'"):
        config = RolloutConfig(kernels="hf")
    assert config.kernels == "torch"
    with pytest.warns(DeprecationWarning):
        old = run(model, kernels="hf")
    new = run(model, kernels="torch")
    assert old.tokens == new.tokens and old.logprobs == new.logprobs and old.profile.plan == new.profile.plan


def test_invariant_puts_linears_attention_and_elementwise_on_the_cpu_kernels(tiny_models, kernel_calls):
    model = tiny_models("tiny-llama")
    plan = run(model, kernels="invariant").profile.plan
    kernel_ops = ("linear", "prefill_attention", "decode_attention", "shared_prefix_attention", *ELEMENTWISE)
    assert {op: plan[op] for op in kernel_ops} == dict.fromkeys(kernel_ops, "cpu")
    assert kernel_calls["rotary"] > 0 and kernel_calls["attention"] > 0
    assert plan["reasons"]["linear"] == "kernels='invariant': the batch-invariant kernel set"


def test_the_plan_is_this_threads_alone_and_closes_with_the_call(tiny_models):
    model = tiny_models("tiny-llama")
    seen_elsewhere, seen_inside = [], []

    def other_thread():
        seen_elsewhere.append(active())

    def hook(module, args):
        if not seen_inside:
            seen_inside.append(active().plan)
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()

    handle = model.model.norm.register_forward_pre_hook(hook)
    try:
        run(model, kernels="torch")
    finally:
        handle.remove()
    assert seen_inside[0] is not None and seen_inside[0].kernel_set == "torch"
    assert seen_elsewhere == [ActiveForward()] and active() == ActiveForward()


def test_the_cli_summary_names_each_ops_backend():
    plan = {"linear": "cpu", "rms_norm": "toy", "decode_step": "engine", "reasons": {"linear": "why"}}
    assert plan_line(plan) == "plan: linear=cpu rms_norm=toy decode=engine"


def test_the_auto_policy_takes_the_engine_kernels_where_they_run_and_says_why_not_elsewhere(tiny_models):
    """"auto" (the default `kernels`): the engine's kernel set where it can run the model, the model's own
    linears and attention elsewhere with the engine's other kernels per op, each with its reason."""
    from types import SimpleNamespace

    from autobucket.engine.plan import choose_plan

    auto = SimpleNamespace(kernels="auto", op_backends=None)
    plan = choose_plan(tiny_models("tiny-llama"), auto)
    kernel_ops = ("linear", "prefill_attention", "decode_attention", "shared_prefix_attention", *ELEMENTWISE)
    assert {op: plan.backend_of(op) for op in kernel_ops} == dict.fromkeys(kernel_ops, "cpu")
    invariant = choose_plan(tiny_models("tiny-llama"), SimpleNamespace(kernels="invariant", op_backends=None))
    assert {op: plan.backend_of(op) for op in OPS} == {op: invariant.backend_of(op) for op in OPS}
    eager = choose_plan(tiny_models("tiny-llama", attn_implementation="eager"), auto)
    assert eager.kernel_set == "torch" and eager.backend_of("linear") == "torch"
    assert eager.choice("linear").reason.startswith("kernels='auto': the model's own linears and attention, since")
    assert "does not go through transformers' 'sdpa' interface" in eager.choice("linear").reason
    assert eager.backend_of("rotary") == "cpu"  # an elementwise kernel needs no attention interface
    assert eager.choice("decode_attention").reason.startswith("not cpu: the model's attention does not go")


def test_the_trainer_scope_opens_the_same_context_with_the_trainers_plan(tiny_models):
    import torch

    import autobucket

    model = tiny_models("tiny-llama")
    seen = []
    handle = model.model.norm.register_forward_pre_hook(lambda module, args: seen.append(active().plan))
    try:
        with autobucket.invariant(model), torch.no_grad():
            model(torch.tensor([PROMPTS[0]]))
        model(torch.tensor([PROMPTS[0]]))  # outside the scope: no plan
    finally:
        handle.remove()
    inside, outside = seen
    assert outside is None and inside.kernel_set == "cpu" and inside.decode_step == "model"
    assert inside.backend_of("linear") == "cpu" and inside.backend_of("rms_norm") == "torch"
