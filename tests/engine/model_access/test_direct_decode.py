"""The engine's decode step on the model's modules (`engine/decode/`, `module_ops`) against the oracle it stands in for:
the model's own forward on the same static cache, the same kernels and the same state. Logits and the
K/V each layer writes must be bitwise equal on every Llama-family architecture, fp32 and bf16, with the
default kernels, the invariant kernels and transformers' SDPA, with a padding mask and without one,
under a LoRA adapter. A variant that applies RoPE to the keys only must fail the same comparison (else
the comparison could not see a wrong step). Models the step cannot stand in for get the model's forward."""

from __future__ import annotations

import copy
import dataclasses
import sys
from contextlib import nullcontext

import pytest
import torch
import transformers
from windowed_models import windowed_model
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.engine.batching.model_runner import CacheShape, ModelRunner, RowInsert
from autobucket.engine.decode import eligibility
from autobucket.engine.decode import ops as decode_ops
from autobucket.engine.decode.eligibility import ineligible_reason
from autobucket.engine.decode.forms import ENGINE, MODEL
from autobucket.engine.decode.parts import LlamaParts
from autobucket.engine.intercept.attention import sliding_windows_applied
from autobucket.engine.intercept.kernel_sets import invariant_kernels
from autobucket.engine.kernels.invariant_attention import decode_sdpa
from autobucket.engine.kernels.packed_linear import PackedLinears
from autobucket.engine.model_access.hf_compat import forward_spec
from autobucket.models import build_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_thread")]
# On a transformers release the step was not checked on, the engine runs the model's forward instead (the
# test just below says so); the step's own tests then have nothing to run, and wait for a verified release.
needs_direct_step = pytest.mark.skipif(
    not eligibility.installed_release_verified(),
    reason=f"the direct step is off on transformers {transformers.__version__} (not yet checked on it)",
)

FAMILY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")
PADDED_LENGTHS = (7, 19, 3, 12, 30)  # rows of different lengths: the step gets a padding mask
STEPS = 4


def filled_runner(model, lengths, decode_attention=None) -> ModelRunner:
    prompts = random_prompts(lengths, seed=len(lengths))
    runner = ModelRunner(model, forward_spec(model), CacheShape(len(lengths), max(lengths) + STEPS + 1), 0,
                         model.config.vocab_size, track_seen=False, decode_attention=decode_attention)  # fmt: skip
    output, _ = runner.prefill(prompts)
    runner.insert(output, RowInsert(list(range(len(lengths))), output.last_logits.argmax(-1), list(lengths), None))
    return runner


def step_both_ways(runner: ModelRunner):
    """One decode step at the same front through the engine's step and through the model's forward ->
    (logits, K/V column) of each; the runner then advances with the model's tokens."""
    results = []
    front = runner.store.front
    for form in (ENGINE, MODEL):
        runner.decode_step = form
        runner.prepare_decode()
        logits = runner.decode_logits()
        written = [k[: runner.active_rows, :, front].clone() for k in runner.store.keys]
        written += [v[: runner.active_rows, :, front].clone() for v in runner.store.values]
        results.append((logits, written))
        runner.store.front = front
    runner.decode_step = ENGINE
    runner.store.front = front + 1
    runner.advance(results[1][0].argmax(-1))
    return results


def assert_direct_equals_forward(model, lengths, kernels: str, steps: int = STEPS) -> None:
    decode_attention = decode_sdpa if kernels == "hf" else None  # "sdpa": transformers' own attention
    runner = filled_runner(model, lengths, decode_attention)
    assert runner.parts is not None, ineligible_reason(model)
    scope = invariant_kernels(PackedLinears()) if kernels == "invariant" else nullcontext()
    with torch.inference_mode(), scope:
        for step in range(steps):
            (direct_logits, direct_kv), (model_logits, model_kv) = step_both_ways(runner)
            assert torch.equal(direct_logits, model_logits), f"step {step}: logits differ"
            for layer, (ours, theirs) in enumerate(zip(direct_kv, model_kv, strict=True)):
                assert torch.equal(ours, theirs), f"step {step}: K/V {layer} differs"


@needs_direct_step
@pytest.mark.parametrize("kernels", ["hf", "invariant", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FAMILY)
def test_the_direct_step_is_bitwise_the_models_forward(tiny_models, name, dtype, kernels):
    # a copy: a bf16 round trip of the shared model would leave its fp32 weights rounded for later tests
    model = copy.deepcopy(tiny_models(name)).to(dtype)
    assert_direct_equals_forward(model, PADDED_LENGTHS, kernels)


@needs_direct_step
@pytest.mark.parametrize("kernels", ["hf", "invariant", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_the_direct_step_past_a_sliding_window_is_bitwise_the_models_forward(name, dtype, kernels):
    """A call past the model's 16-token window (rows of 19 and 30 tokens; every Mistral layer windowed,
    one of Qwen2's two): the step hands each layer's window to the dispatcher as the model's attention
    does (Mistral's from its config, Qwen2's from the layer), which narrows that layer's mask. Control:
    without the windows applied the model's own step gives other logits (the window bites)."""
    model = copy.deepcopy(windowed_model(name)).to(dtype)
    with sliding_windows_applied():
        assert_direct_equals_forward(model, PADDED_LENGTHS, kernels)
    windowed, whole = (filled_runner(model, PADDED_LENGTHS) for _ in range(2))
    with torch.inference_mode():
        with sliding_windows_applied():
            windowed.prepare_decode()
            narrowed = windowed.decode_logits()
        whole.prepare_decode()
        assert not torch.equal(narrowed, whole.decode_logits())


@needs_direct_step
def test_the_direct_step_is_bitwise_the_models_forward_without_a_mask(tiny_models):
    # Equal lengths, no gap: the step mask is None, as the model's forward gets it.
    model = tiny_models("tiny-llama")
    runner = filled_runner(model, (9, 9, 9))
    assert runner.store.step_mask() is None
    assert_direct_equals_forward(model, (9, 9, 9), "hf")


@needs_direct_step
def test_the_direct_step_runs_a_lora_adapter_as_the_model_does():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = peft.get_peft_model(build_tiny_model("tiny-qwen2", seed=5), config).eval().get_base_model()
    assert_direct_equals_forward(model, PADDED_LENGTHS, "invariant")
    assert_direct_equals_forward(model, PADDED_LENGTHS, "hf")


@needs_direct_step
def test_control_a_step_that_rotates_only_the_keys_differs_from_the_forward(tiny_models, monkeypatch):
    model = tiny_models("tiny-llama")
    runner = filled_runner(model, PADDED_LENGTHS, decode_sdpa)
    module_ops = decode_ops.module_ops

    def keys_only_rotated(*args):
        ops = module_ops(*args)
        return dataclasses.replace(ops, rotary=lambda q, k, cos, sin: (q, ops.rotary(q, k, cos, sin)[1]))

    monkeypatch.setattr(decode_ops, "module_ops", keys_only_rotated)
    with torch.inference_mode():
        (wrong_logits, _), (model_logits, _) = step_both_ways(runner)
    assert not torch.equal(wrong_logits, model_logits)


@needs_direct_step
def test_models_it_cannot_stand_in_for_get_their_own_forward(tiny_models):
    assert LlamaParts.of(tiny_models("tiny-opt")) is None
    assert LlamaParts.of(tiny_models("tiny-gpt2")) is None
    assert "sdpa" in ineligible_reason(tiny_models("tiny-llama", attn_implementation="eager"))
    hooked = build_tiny_model("tiny-llama", seed=2)
    assert LlamaParts.of(hooked) is not None
    handle = hooked.model.layers[1].register_forward_pre_hook(lambda module, args: None)
    assert "hooks" in ineligible_reason(hooked)
    handle.remove()
    assert LlamaParts.of(hooked) is not None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        assert "hooks" in ineligible_reason(hooked)
    finally:
        handle.remove()

    hooked.model.layers[0].mlp.forward = lambda x: x  # instrumentation, or a test's wrapper, on the instance
    assert "replaced" in ineligible_reason(hooked)
    del hooked.model.layers[0].mlp.forward
    assert LlamaParts.of(hooked) is not None

    class CustomLlama(type(hooked)):  # a subclass may override any forward
        pass

    custom = CustomLlama(hooked.config)
    assert "not a transformers" in ineligible_reason(custom)


def test_a_transformers_release_it_was_not_checked_on_gets_the_models_forward(tiny_models, monkeypatch):
    assert eligibility.transformers_verified("4.57.6") and eligibility.transformers_verified("5.25.0")
    assert eligibility.transformers_verified("5.3.0.dev0")
    assert not eligibility.transformers_verified("5.26.0") and not eligibility.transformers_verified("4.56.2")
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.99.0")  # the module the engine imports
    assert "checked on" in ineligible_reason(tiny_models("tiny-llama"))


@needs_direct_step
def test_a_forward_replaced_on_a_class_gets_the_models_forward(monkeypatch):
    # What a kernel library does (Liger replaces a causal LM's forward on its class): the direct step
    # would bypass it, so the model's own forward runs.
    model = build_tiny_model("tiny-qwen2", seed=3)
    forward = type(model.model.layers[0].self_attn).forward
    monkeypatch.setattr(type(model.model.layers[0].self_attn), "forward", lambda self, *a, **k: forward(self, *a, **k))
    assert "replaced" in ineligible_reason(model)


@needs_direct_step
def test_a_rollout_on_the_direct_step_matches_one_on_the_models_forward(tiny_models, monkeypatch):
    # End to end, with refill, a penalty and sampling: the direct step's call gives the tokens and
    # logprobs of the same call with the model's forward in every step.
    model = tiny_models("tiny-qwen3")
    prompts = random_prompts([5, 17, 30, 3, 9, 12, 21], seed=8)
    sampling = SamplingConfig(max_new_tokens=8, continuous_batch_size=3, temperature=1.0, seed=4, n=2,
                              logprobs=True, repetition_penalty=1.2)  # fmt: skip
    config = RolloutConfig(route="bucketed", costs=CostCoefficients())
    direct = Rollout(model, config=config).generate(prompts, sampling)
    assert direct.profile.decode_forward == "direct"
    monkeypatch.setattr(LlamaParts, "of", classmethod(lambda cls, model: None))
    forward = Rollout(model, config=config).generate(prompts, sampling)
    assert forward.profile.decode_forward == "model"
    assert direct.tokens == forward.tokens and direct.logprobs == forward.logprobs
