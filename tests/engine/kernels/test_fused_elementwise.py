"""The fused elementwise kernels against their oracles, the model's own code: the rotary embedding
(`engine/kernels/elementwise/`): the rotary embedding against the modeling module's `apply_rotary_pos_emb`
in fp32 and bf16 on the layouts the models hand over, SiLU-and-multiply against `F.silu(gate) * up` on
1-3 threads and RMSNorm against the module on row lengths with and without vector tails, both in fp32 and
bf16; rollouts (fp32 and bf16) that give
the same tokens and log-probabilities with them and without them (the direct decode step still on); the
modeling module and its classes left as found. Controls: a rotary with a flipped sign, a SiLU rounded
once from float64 and an RMSNorm summing in another order must fail the same comparisons (and the
router's probe must refuse the rotary), and a function someone else put in the module, or a hook on the
activation, must keep running."""

from __future__ import annotations

import functools
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.engine.decode import eligibility
from autobucket.engine.intercept import elementwise as fused_scope
from autobucket.engine.intercept.elementwise import fused_elementwise
from autobucket.engine.kernels.elementwise import gated_mlp, rms_norm, rotary
from autobucket.engine.kernels.elementwise.gated_mlp import silu_and_mul
from autobucket.engine.kernels.elementwise.rotary import fused_rotary_embedding, kernel_takes
from autobucket.engine.kernels.library import load_invariant_kernels
from autobucket.models import build_tiny_model

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
    assert rotary.router_for(flipped) is None
    assert rotary.router_for(builtin) is not None


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
    with pytest.MonkeyPatch.context() as patch:
        if not fused:  # the fused scope then finds no Llama-family modeling module and routes nothing
            patch.setattr(fused_scope, "llama_modeling_module", lambda model: None)
        # eager decode steps (also under `make test-compile`): a compiled graph traces the model's own code, and
        # installing the routers for one call and not the next changes what dynamo guards on, so the step
        # recompiles (and past the recompile cap decodes eagerly: different last bits from a compiled step,
        # whatever the kernels)
        # and a continuous-batching route named, not "auto": its cost model may choose HF generate for a
        # call this small, which runs no decode step of the engine's (`decode_forward` is then ""); with
        # fixed costs, since buckets planned from costs learned online (the first call's timings) can move
        # between the two calls, and kernels="torch" gives a prompt other last bits in another bucket
        # kernels="torch" runs the model's own elementwise code unless the config gives the ops to the kernels
        asked = {op: "cpu" for op in ("rotary", "gated_mlp", "rms_norm")} if fused and kernels == "torch" else None
        config = RolloutConfig(route="bucketed", kernels=kernels, compile=False, costs=CostCoefficients(), op_backends=asked)
        return Rollout(model, config=config).generate(random_prompts((5, 23, 11, 40, 2), seed=0), sampling)


def counting(monkeypatch, module, name):
    calls = []
    inner = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or inner(*a))
    return calls


@pytest.mark.parametrize("kernels", ["torch", "invariant"])
@pytest.mark.parametrize("name", FAMILY)
def test_rollouts_with_and_without_the_fused_kernels_agree_bitwise(tiny_models, name, kernels, monkeypatch):
    model = tiny_models(name)
    calls = [counting(monkeypatch, rotary, "fused_rotary_embedding"), counting(monkeypatch, gated_mlp, "silu_and_mul"),
             counting(monkeypatch, rms_norm, "rms_norm")]  # fmt: skip
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3, logprobs=True, eos_token_id=[])
    modeling = modeling_of(model)
    layer = model.model.layers[0]
    classes = type(layer.mlp), type(layer.input_layernorm)
    builtins = modeling.apply_rotary_pos_emb, *(cls.forward for cls in classes)
    fused = generate(model, sampling, True, kernels)
    assert all(calls), "the engine's forwards did not reach every fused kernel"
    # the MLP's router counts as the class's own forward (on a transformers release the direct step was
    # checked on; on a newer one every decode step runs the model's forward, by design)
    expected = "direct" if eligibility.installed_release_verified() else "model"
    assert fused.profile.decode_forward == expected
    assert (modeling.apply_rotary_pos_emb, *(cls.forward for cls in classes)) == builtins  # all as found
    for counted in calls:
        counted.clear()
    eager = generate(model, sampling, False, kernels)
    assert not any(calls)
    assert fused.tokens == eager.tokens
    assert all(torch.equal(torch.tensor(a), torch.tensor(b)) for a, b in zip(fused.logprobs, eager.logprobs, strict=True))


@pytest.mark.parametrize("kernels", ["torch", "invariant"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_bf16_rollouts_with_and_without_the_fused_kernels_agree_bitwise(name, kernels, monkeypatch):
    model = build_tiny_model(name, dtype=torch.bfloat16)
    rotations, norms = counting(monkeypatch, rotary, "fused_rotary_embedding"), counting(monkeypatch, rms_norm, "rms_norm")
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3, logprobs=True, eos_token_id=[])
    fused = generate(model, sampling, True, kernels)
    assert rotations and norms  # (the bf16 product stays eager: not faster fused)
    eager = generate(model, sampling, False, kernels)
    assert fused.tokens == eager.tokens
    assert all(torch.equal(torch.tensor(a), torch.tensor(b)) for a, b in zip(fused.logprobs, eager.logprobs, strict=True))


def test_other_threads_and_gradients_get_the_models_function(tiny_models, monkeypatch):
    model = tiny_models("tiny-llama")
    modeling = modeling_of(model)
    calls = counting(monkeypatch, rotary, "fused_rotary_embedding")
    q, k, cos, sin = rotary_inputs(1, 9, 4, 2, 16, torch.float32)
    with fused_elementwise(model):
        calls.clear()  # a process's first scope probes the kernel against the model's function
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


def test_a_direct_step_built_before_the_scope_takes_the_fused_rotary_inside_it(tiny_models, monkeypatch):
    """The direct decode step looks the modeling module's function up at each step, as the model's
    attention does, so the kernel serves it whenever the step was built; outside the scope it runs the
    model's function again."""
    from autobucket.engine.batching.model_runner import CacheShape, ModelRunner, RowInsert
    from autobucket.engine.model_access.hf_compat import forward_spec

    model = tiny_models("tiny-qwen2")
    runner = ModelRunner(model, forward_spec(model), CacheShape(2, 12), 0, model.config.vocab_size, track_seen=False)
    if runner.parts is None:
        pytest.skip("the direct step is off on this transformers release")
    with torch.inference_mode():
        output, _ = runner.prefill(random_prompts([5, 8], seed=1))
        runner.insert(output, RowInsert([0, 1], output.last_logits.argmax(-1), [5, 8], None))
        calls = counting(monkeypatch, rotary, "fused_rotary_embedding")
        with fused_elementwise(model):
            calls.clear()  # a process's first scope probes the kernel
            runner.prepare_decode()
            fused_logits = runner.decode_logits()
        assert len(calls) == model.config.num_hidden_layers  # every layer's rotary on the kernel
        runner.store.front -= 1  # the same step again, outside the scope
        runner.prepare_decode()
        eager_logits = runner.decode_logits()
    assert len(calls) == model.config.num_hidden_layers  # outside it: the model's function
    assert torch.equal(fused_logits, eager_logits)


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


# SiLU-and-multiply: shapes whose element counts split among threads at points that are not multiples of
# ATen's 32-float vector step (so some elements are scalar tails there), and values at exp's extremes
SILU_SHAPES = [(2025, 1024), (1, 37), (7, 45), (33, 1000), (3, 100003), (32, 1, 1024), (1, 5, 1536)]
EXTREMES = [0.0, -0.0, 80.0, -80.0, 100.0, -100.0, 1e-30, -1e-30, float("inf"), -float("inf"), 88.7, -88.7, -103.0]


def silu_operands(shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    gate = torch.randn(*shape, generator=generator) * 6
    up = torch.randn(*shape, generator=generator)
    flat = gate.view(-1)
    flat[: min(len(EXTREMES), flat.numel())] = torch.tensor(EXTREMES)[: flat.numel()]
    return gate, up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_silu_and_mul_is_bitwise_the_eager_ops_on_any_thread_count(threads, dtype):
    if not gated_mlp.available():
        pytest.skip("ATen's kernels here are not of the width the library builds: the eager ops run")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape in SILU_SHAPES:
            gate, up = (operand.to(dtype) for operand in silu_operands(shape))
            want, got = F.silu(gate) * up, silu_and_mul(gate, up)
            assert torch.equal(want.isnan(), got.isnan()), shape
            assert torch.equal(want.nan_to_num(), got.nan_to_num()), shape
    finally:
        torch.set_num_threads(before)


def test_control_a_silu_rounded_once_from_float64_fails_the_comparison():
    gate, up = silu_operands((2025, 1024))
    once = (torch.nn.functional.silu(gate.double()) * up.double()).float()
    assert not torch.equal(F.silu(gate) * up, once)


def test_a_hooked_activation_and_other_threads_get_the_mlps_own_forward(tiny_models, monkeypatch):
    model = tiny_models("tiny-llama")
    products = counting(monkeypatch, gated_mlp, "silu_and_mul")
    mlp = model.model.layers[0].mlp
    hidden = torch.randn(3, 5, model.config.hidden_size)
    with torch.inference_mode(), fused_elementwise(model):
        want = type(mlp).forward._autobucket_builtin(mlp, hidden)
        other = threading.Thread(target=lambda: type(mlp).forward(mlp, hidden))
        other.start()
        other.join()
        assert not products  # the other thread ran the class's own forward
        assert torch.equal(mlp(hidden), want) and products == [1]  # this thread: the fused product
        seen = []
        handle = mlp.act_fn.register_forward_hook(lambda *args: seen.append(1))
        try:
            assert torch.equal(mlp(hidden), want)
        finally:
            handle.remove()
        assert seen == [1] and products == [1]  # the hook ran: the activation was called, not fused
    assert not hasattr(type(mlp).forward, "_autobucket_builtin")


NORM_LENGTHS = (8, 16, 64, 100, 256, 576, 896, 1000, 2048, 4096)  # tails, and > 512: ATen's cascade levels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_is_bitwise_the_module_on_any_row_length(tiny_models, threads, dtype):
    if not rms_norm.available():
        pytest.skip("ATen's sum does not run its 8-float vector kernel here: the eager module runs")
    norm_class = type(tiny_models("tiny-llama").model.norm)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    try:
        for length in NORM_LENGTHS:
            norm = norm_class(length, eps=1e-6).to(dtype)
            norm.weight.data = torch.randn(length, generator=generator).to(dtype)
            for rows in ((1,), (7,), (3, 33)):
                # magnitudes over several orders, so that the order of the sum shows in the last bits
                hidden = torch.randn(*rows, length, generator=generator)
                hidden *= torch.exp(3 * torch.randn(*rows, length, generator=generator))
                hidden = hidden.to(dtype)
                with torch.inference_mode():
                    assert torch.equal(norm(hidden), rms_norm.rms_norm(hidden, norm.weight, 1e-6)), (length, rows)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 3.3e-7])
def test_rms_norm_rounds_each_rows_variance_eps_and_rsqrt_as_the_module(tiny_models, eps):
    """The kernel divides, adds eps and takes 1 / sqrt per row itself: on many rows whose variances lie
    near eps (where its rounding to float matters) and far from it, bitwise the module's ATen ops."""
    if not rms_norm.available():
        pytest.skip("ATen's sum does not run its 8-float vector kernel here: the eager module runs")
    norm = type(tiny_models("tiny-llama").model.norm)(64, eps=eps)
    generator = torch.Generator().manual_seed(2)
    scales = 10 ** (5 * torch.rand(20_000, 1, generator=generator) - 4)  # row magnitudes 1e-4 .. 10
    hidden = torch.randn(20_000, 64, generator=generator) * scales
    with torch.inference_mode():
        want = norm(hidden)
        assert torch.equal(rms_norm.rms_norm(hidden, norm.weight, eps), want)
        # control: the same sums with the scale as the expression `1 / sqrt(v)` (torch divides through a
        # reciprocal) must miss the module somewhere, or this test could not see the per-row rounding
        variance = hidden.pow(2).mean(-1, keepdim=True)
        assert not torch.equal(norm.weight * (hidden * (1.0 / torch.sqrt(variance + eps))), want)


def test_control_an_rms_norm_summing_in_another_order_fails_the_comparison(tiny_models):
    norm = type(tiny_models("tiny-llama").model.norm)(256, eps=1e-6)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 256, generator=generator) * torch.exp(3 * torch.randn(64, 256, generator=generator))
    with torch.inference_mode():
        squares = hidden.pow(2)
        in_order = torch.stack([functools.reduce(lambda a, b: a + b, row) for row in squares]).unsqueeze(-1)
        other = norm.weight * (hidden * torch.rsqrt(in_order / 256 + 1e-6))
        assert not torch.equal(norm(hidden), other)
