"""The fused rotary embedding (`engine/kernels/rotary.py`, `csrc/rotary.cpp`) against its oracle, the
model's own `apply_rotary_pos_emb`: bitwise equal outputs in fp32 and bf16 on the layouts the models
hand over, rollouts that give the same tokens and log-probabilities with it and without it, and the
modeling module left as found. Controls: a rotary with a flipped sign must fail the same comparison (and
the router's probe must refuse it), and a function someone else put in the module must keep running."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from conftest import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.kernels import rotary
from autobucket.engine.kernels.invariant_attention import load_invariant_kernels
from autobucket.engine.kernels.rotary import (
    fused_rotary,
    fused_rotary_embedding,
    kernel_takes,
    set_fused_rotary,
)

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_thread")]

FAMILY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")


def modeling_of(model):
    return sys.modules[type(model).__module__]


def rotary_inputs(batch, tokens, heads, kv_heads, head_dim, dtype, cos_batch=None, transposed=True, seed=0):
    """q, k as the models lay them out (`view(B, T, H, D).transpose(1, 2)`, or contiguous), cos and sin [B | 1, T, D]."""
    generator = torch.Generator().manual_seed(seed)

    def heads_of(count):
        if transposed:
            return torch.randn(batch, tokens, count, head_dim, generator=generator).to(dtype).transpose(1, 2)
        return torch.randn(batch, count, tokens, head_dim, generator=generator).to(dtype)

    q, k = heads_of(heads), heads_of(kv_heads)
    cos, sin = (torch.randn(cos_batch or batch, tokens, head_dim, generator=generator).to(dtype) for _ in range(2))
    return q, k, cos, sin


def strides_of_real_dimensions(tensor):
    return [stride for stride, size in zip(tensor.stride(), tensor.shape, strict=True) if size > 1]


def assert_same_outputs(want, got):
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
        # strides of the dimensions that have more than one element (a size-1 dimension's stride is free)
        assert strides_of_real_dimensions(w) == strides_of_real_dimensions(g)


LAYOUTS = [  # (batch, tokens, heads, kv_heads, head_dim, cos batch, transposed)
    (1, 37, 4, 2, 64, 1, True),  # a packed prefill: one row, positions restarting per prompt
    (3, 5, 4, 4, 32, 3, True),  # a padded prefill
    (4, 1, 9, 3, 64, 4, True),  # a decode step
    (2, 6, 2, 1, 16, 1, False),  # contiguous heads
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FAMILY)
def test_the_fused_rotary_is_bitwise_the_models_function(tiny_models, name, layout, dtype):
    load_invariant_kernels()
    builtin = modeling_of(tiny_models(name)).apply_rotary_pos_emb
    batch, tokens, heads, kv_heads, head_dim, cos_batch, transposed = layout
    q, k, cos, sin = rotary_inputs(batch, tokens, heads, kv_heads, head_dim, dtype, cos_batch, transposed)
    assert kernel_takes(q, k, cos, sin, (), {})
    assert_same_outputs(builtin(q, k, cos, sin), fused_rotary_embedding(q, k, cos, sin))


def test_control_a_rotary_with_a_flipped_sign_fails_the_comparison_and_the_probe(tiny_models):
    load_invariant_kernels()
    builtin = modeling_of(tiny_models("tiny-qwen2")).apply_rotary_pos_emb

    def flipped(q, k, cos, sin, unsqueeze_dim=1):
        return builtin(q, k, cos, -sin, unsqueeze_dim)

    q, k, cos, sin = rotary_inputs(1, 37, 4, 2, 64, torch.float32)
    with pytest.raises(AssertionError):
        assert_same_outputs(flipped(q, k, cos, sin), fused_rotary_embedding(q, k, cos, sin))
    assert rotary._router_for(flipped) is None
    assert rotary._router_for(builtin) is not None


def test_calls_the_kernel_cannot_take_run_the_models_function():
    q, k, cos, sin = rotary_inputs(2, 5, 4, 2, 32, torch.float32)
    assert not kernel_takes(q, k, cos, sin, (), {"unsqueeze_dim": 2})
    assert not kernel_takes(q, k, cos, sin, (None, 1), {})
    assert not kernel_takes(q.half(), k.half(), cos.half(), sin.half(), (), {})
    assert not kernel_takes(q, k, cos.double(), sin.double(), (), {})
    assert not kernel_takes(q[..., :31], k[..., :31], cos[..., :31], sin[..., :31], (), {})  # odd head_dim
    wants_grad = q.clone().requires_grad_(True)
    assert not kernel_takes(wants_grad, k, cos, sin, (), {})
    with torch.no_grad():
        assert kernel_takes(wants_grad, k, cos, sin, (), {})


def generate(model, sampling, fused: bool, kernels: str):
    previous = set_fused_rotary(fused)
    try:
        return Rollout(model, config=RolloutConfig(kernels=kernels)).generate(
            random_prompts((5, 23, 11, 40, 2), seed=0), sampling
        )
    finally:
        set_fused_rotary(previous)


@pytest.mark.parametrize("kernels", ["hf", "invariant"])
@pytest.mark.parametrize("name", FAMILY)
def test_rollouts_with_and_without_the_fused_rotary_agree_bitwise(tiny_models, name, kernels, monkeypatch):
    model = tiny_models(name)
    calls = []
    monkeypatch.setattr(rotary, "fused_rotary_embedding", lambda *a: calls.append(1) or fused_rotary_embedding(*a))
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3, logprobs=True, eos_token_id=[])
    builtin = modeling_of(model).apply_rotary_pos_emb
    fused = generate(model, sampling, True, kernels)
    assert calls, "the engine's forwards did not reach the fused kernel"
    assert modeling_of(model).apply_rotary_pos_emb is builtin  # the module as found
    calls.clear()
    eager = generate(model, sampling, False, kernels)
    assert not calls
    assert fused.tokens == eager.tokens
    assert all(torch.equal(torch.tensor(a), torch.tensor(b)) for a, b in zip(fused.logprobs, eager.logprobs, strict=True))


def test_other_threads_and_gradients_get_the_models_function(tiny_models, monkeypatch):
    model = tiny_models("tiny-llama")
    modeling = modeling_of(model)
    calls = []
    monkeypatch.setattr(rotary, "fused_rotary_embedding", lambda *a: calls.append(1) or fused_rotary_embedding(*a))
    q, k, cos, sin = rotary_inputs(1, 9, 4, 2, 16, torch.float32)
    with fused_rotary(model):
        routed = modeling.apply_rotary_pos_emb
        assert routed.__name__ == "routed_apply_rotary_pos_emb"
        other = threading.Thread(target=lambda: routed(q, k, cos, sin))
        other.start()
        other.join()
        assert not calls  # the other thread ran the model's function
        grad_q = q.clone().requires_grad_(True)
        out, _ = routed(grad_q, k, cos, sin)
        assert out.grad_fn is not None and not calls  # a gradient wanted: the model's function
        routed(q, k, cos, sin)
        assert calls == [1]  # this thread, no gradient: the kernel
    assert modeling.apply_rotary_pos_emb is not routed


def test_a_function_someone_else_put_in_the_module_keeps_running(tiny_models, monkeypatch):
    model = tiny_models("tiny-qwen2")
    modeling = modeling_of(model)
    builtin = modeling.apply_rotary_pos_emb
    calls = []

    def instrumented(*args, **kwargs):  # as a kernel library or a profiler would install it
        calls.append(1)
        return builtin(*args, **kwargs)

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", instrumented)
    Rollout(model).generate(random_prompts((4, 9), seed=1), SamplingConfig(max_new_tokens=3))
    assert calls and modeling.apply_rotary_pos_emb is instrumented
