"""A backend registered by a user supplies one op (an RMSNorm); the forward plan picks it where
`RolloutConfig(op_backends=...)` asks, `Profile.plan` reports it, and the call runs it.

Oracles: single-request HF `generate` (tokens), the model's own RMSNorm (a toy norm that adds a zero is
bitwise it); negative control: a toy norm that adds 1e-3 changes the logprobs."""

from __future__ import annotations

import pytest
import torch
from oracles import hf_greedy
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.engine.plan import Backend, register_backend
from autobucket.engine.plan.backends import backend_names

PROMPTS = random_prompts((5, 17, 9), seed=4)
NEW_TOKENS = 6


class ToyNorm(Backend):
    """The Llama family's RMSNorm written out (as its modeling file computes it), plus `shift`."""

    def __init__(self, name: str, shift: float) -> None:
        self.name, self.shift, self.calls = name, shift, 0

    def supply(self, op, model):
        if op != "rms_norm":
            return super().supply(op, model)
        return self.forward

    def forward(self, module, hidden, *args, **kwargs):
        if args or kwargs:
            return NotImplemented
        self.calls += 1
        variance = hidden.to(torch.float32).pow(2).mean(-1, keepdim=True)
        normed = hidden.to(torch.float32) * torch.rsqrt(variance + module.variance_epsilon)
        return module.weight * normed.to(hidden.dtype) + self.shift


def run(model, op_backends=None, kernels="torch"):
    config = RolloutConfig(route="bucketed", kernels=kernels, compile=False, costs=CostCoefficients(), op_backends=op_backends)
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, logprobs=True, eos_token_id=[])
    return Rollout(model, config=config).generate(PROMPTS, sampling)


def same_logprobs(a, b) -> bool:
    return all(torch.equal(torch.tensor(x), torch.tensor(y)) for x, y in zip(a.logprobs, b.logprobs, strict=True))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_a_registered_backend_runs_the_op_the_plan_gives_it(tiny_models, name):
    model = tiny_models(name)
    toy = register_backend(ToyNorm("toy-zero", 0.0))
    plain = run(model)
    result = run(model, {"rms_norm": "toy-zero"})
    assert toy.calls > 0  # the forwards reached it
    assert result.profile.plan["rms_norm"] == "toy-zero"
    assert result.profile.plan["reasons"]["rms_norm"] == "asked for in RolloutConfig(op_backends=...)"
    assert plain.profile.plan["rms_norm"] == "torch"
    assert result.tokens == hf_greedy(model, PROMPTS, NEW_TOKENS)
    assert same_logprobs(result, plain)
    calls = toy.calls
    run(model)  # a later call that does not ask for it
    assert toy.calls == calls


def test_a_backend_that_changes_the_values_changes_the_logprobs(tiny_models):
    """Negative control: the op really runs on the backend (a norm off by 1e-3 moves every logprob)."""
    model = tiny_models("tiny-llama")
    register_backend(ToyNorm("toy-shifted", 1e-3))
    assert not same_logprobs(run(model, {"rms_norm": "toy-shifted"}), run(model))


def test_other_threads_keep_the_models_norm(tiny_models):
    import threading

    model = tiny_models("tiny-llama")
    toy = register_backend(ToyNorm("toy-threads", 0.0))
    seen_elsewhere = []

    def other_forward():
        calls = toy.calls
        with torch.no_grad():
            model(torch.tensor([PROMPTS[0]]))
        seen_elsewhere.append(toy.calls - calls)

    original = toy.forward

    def forward_and_run_other(module, hidden, *args, **kwargs):
        if not seen_elsewhere:
            thread = threading.Thread(target=other_forward)
            thread.start()
            thread.join()
        return original(module, hidden, *args, **kwargs)

    toy.forward = forward_and_run_other
    run(model, {"rms_norm": "toy-threads"})
    assert seen_elsewhere == [0]  # the other thread's forward, mid-call, ran the model's own norm


def test_op_backends_refuses_unknown_ops_and_backends(tiny_models):
    model = tiny_models("tiny-llama")
    with pytest.raises(ValueError, match=r"'norm', which is no op family: choose from linear, .*rms_norm"):
        Rollout(model, config=RolloutConfig(op_backends={"norm": "cpu"}))
    with pytest.raises(ValueError, match=r"no backend is registered as 'nowhere': choose one of torch, cpu, triton"):
        Rollout(model, config=RolloutConfig(op_backends={"rms_norm": "nowhere"}))
    with pytest.raises(ValueError, match=r"linear follows the kernel set"):
        Rollout(model, config=RolloutConfig(op_backends={"linear": "cpu"}))
    with pytest.raises(TypeError, match="op_backends"):
        RolloutConfig(op_backends={"rms_norm": 3})
    register_backend(ToyNorm("toy-norm-only", 0.0))
    rollout = Rollout(model, config=RolloutConfig(op_backends={"rotary": "toy-norm-only"}))
    with pytest.raises(ValueError, match=r"the 'toy-norm-only' backend has no rotary"):
        rollout.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=2))
    assert run(model).tokens == hf_greedy(model, PROMPTS, NEW_TOKENS)  # the engine is usable afterwards
    assert {"torch", "cpu", "triton"} <= set(backend_names())
