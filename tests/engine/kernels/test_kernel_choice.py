"""`kernels="auto"`, the default: the engine's kernels wherever they can run the model, the model's own ops
elsewhere, with the reason on `Profile`. Where the engine's kernels run, its tokens and logprobs are bitwise
`kernels="invariant"`'s; where they cannot, its tokens are single-request HF `generate`'s and
`kernels="invariant"` still refuses the model. "auto" itself is never refused."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
from oracles import oracle_generate
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.costs.store import entry_key
from autobucket.engine.kernel_choice import resolve_kernels
from autobucket.models import CACHE_DIR_ENV

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_thread")]

PROMPTS = random_prompts([5, 19, 9], seed=7)
NEW_TOKENS = 6
SAMPLING = SamplingConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[], logprobs=True)
FIXED_COSTS = CostCoefficients()  # no online probe: the calls here are about kernels, not costs
ROUTES = ("ordinary", "aligned", "bucketed")


def generate(model, kernels: str, route: str = "aligned"):
    # compile=False: `make test-compile` turns the default on, and compile=True takes the model's own ops
    config = RolloutConfig(route=route, kernels=kernels, costs=FIXED_COSTS, compile=False)
    rollout = Rollout(model, None, config)
    return rollout.generate(PROMPTS, SAMPLING)


def hf_tokens(model) -> list[list[int]]:
    return [oracle_generate(model, prompt, NEW_TOKENS, eos_token_id=[])[0] for prompt in PROMPTS]


# ------------------------------------------------------------------ where the engine's kernels run
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_runs_the_engine_kernels_on_a_cpu_sdpa_model_bitwise_as_invariant(tiny_models, dtype):
    model = copy.deepcopy(tiny_models("tiny-qwen2")).to(dtype)
    assert RolloutConfig().kernels == "auto"
    for route in ROUTES:
        auto, invariant = generate(model, "auto", route), generate(model, "invariant", route)
        assert (auto.profile.kernels, invariant.profile.kernels) == ("invariant", "invariant")
        assert "engine's kernels" in auto.profile.kernels_reason
        assert auto.tokens == invariant.tokens, route
        assert auto.logprobs == invariant.logprobs, route  # bitwise: the same kernels ran
    # Negative control: the model's own ops give other logprob bits, so the equality above is the kernels'.
    hf = generate(model, "torch")
    assert hf.profile.kernels == "torch"
    assert hf.logprobs != generate(model, "invariant").logprobs


def test_the_default_config_runs_auto(tiny_models):
    config = RolloutConfig(costs=FIXED_COSTS)
    ran = "auto" if config.compile is True else "invariant"  # `make test-compile` defaults compile=True
    result = Rollout(tiny_models("tiny-qwen2"), None, config).generate(PROMPTS, SAMPLING)
    assert (result.profile.kernels, result.profile.kernels_reason.startswith("auto:")) == (ran, True)
    expected = Rollout(tiny_models("tiny-qwen2"), None, dataclasses.replace(config, kernels=ran))
    assert result.logprobs == expected.generate(PROMPTS, SAMPLING).logprobs


# ------------------------------------------------------------------ where they cannot: the model's own ops
class SelfCallingAttention(torch.nn.Module):
    """Marks an attention class whose modeling file calls torch's SDPA itself (as Falcon and StableLM did
    before transformers 5): this test module has no `ALL_ATTENTION_FUNCTIONS`, so the engine's dispatcher,
    and its attention kernel, are out of the layer's reach."""


def self_calling_sdpa_model(tiny_models):
    """tiny-llama whose attention layers call transformers' own SDPA function under a private registry
    name (never the engine's hooked "sdpa"), from a class of this module: configured for SDPA, out of reach."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("autobucket_test_direct_sdpa", sdpa_attention_forward)
    model = copy.deepcopy(tiny_models("tiny-llama"))
    for module in list(model.modules()):
        if type(module).__name__ == "LlamaAttention":
            module.__class__ = type("LlamaAttention", (SelfCallingAttention, type(module)), {})
            module.config = copy.copy(module.config)
            module.config._attn_implementation = "autobucket_test_direct_sdpa"
    assert model.config._attn_implementation == "sdpa"
    return model


def fp16_model(tiny_models):
    return copy.deepcopy(tiny_models("tiny-qwen2")).half()


def eager_model(tiny_models):
    return tiny_models("tiny-qwen2", attn_implementation="eager")


FALLBACKS = {
    "fp16": (fp16_model, r"float16 and the engine's kernels compute in float32 or bfloat16",
             r"computes in float32 or bfloat16, but Qwen2ForCausalLM is float16"),
    "eager": (eager_model, r"attn_implementation='eager'\) does not go through transformers' 'sdpa'",
              r"attn_implementation='eager'"),
    "self-calling-sdpa": (self_calling_sdpa_model, r"attn_implementation='sdpa'\) does not go through",
                          r"attention layers call torch's SDPA themselves"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_auto_falls_back_to_the_model_ops_with_the_reason_and_matches_hf_generate(tiny_models, case):
    build, reason, refusal = FALLBACKS[case]
    model = build(tiny_models)
    expected = hf_tokens(model)
    for route in ROUTES:
        result = generate(model, "auto", route)
        assert result.profile.kernels == "auto", route
        assert result.profile.kernels_reason.startswith("auto: the model's own linears and attention, since ")
        assert re.search(reason, result.profile.kernels_reason), result.profile.kernels_reason
        assert result.tokens == expected, f"{case} {route}"
    with pytest.raises(ValueError, match=refusal):  # requiring the guarantee is still refused
        generate(model, "invariant")


def test_the_fallback_is_the_models_own_set_not_the_engine_kernels(tiny_models):
    """Negative control for the fallback tests: on an fp32 SDPA model, where "auto" takes the engine's
    kernels, its logprobs are not the model's own ops' (so the fallback above is what ran, not a label)."""
    model = tiny_models("tiny-qwen2")
    assert generate(model, "auto").logprobs != generate(model, "torch").logprobs


def test_compile_true_takes_the_model_ops_and_compile_auto_the_engine_kernels(tiny_models):
    model = tiny_models("tiny-qwen2")
    kernels, reason = resolve_kernels(model, RolloutConfig(compile=True))
    assert (kernels, "compile=True" in reason) == ("auto", True)
    assert resolve_kernels(model, RolloutConfig(compile="auto")).kernels == "invariant"
    assert resolve_kernels(model, RolloutConfig(compile=True, kernels="invariant")).kernels == "invariant"


def test_auto_chooses_again_when_the_trainer_changes_the_model(tiny_models):
    model = copy.deepcopy(tiny_models("tiny-qwen2"))
    rollout = Rollout(model, None, RolloutConfig(route="aligned", costs=FIXED_COSTS, compile=False))
    assert rollout.generate(PROMPTS, SAMPLING).profile.kernels == "invariant"
    model.half()  # a trainer's cast between calls
    result = rollout.generate(PROMPTS, SAMPLING)
    assert (result.profile.kernels, "float16" in result.profile.kernels_reason) == ("auto", True)
    assert result.tokens == hf_tokens(model)
    model.float()
    assert rollout.generate(PROMPTS, SAMPLING).profile.kernels == "invariant"


def test_a_model_off_the_cpu_takes_the_model_ops(tiny_models):
    """Off the CPU (CUDA's Triton set is not chosen by default) "auto" takes the model's own ops."""
    model = copy.deepcopy(tiny_models("tiny-qwen2")).to("meta")
    kernels, reason = resolve_kernels(model, RolloutConfig(compile=False))
    assert (kernels, "is on meta" in reason) == ("auto", True)
    assert resolve_kernels(model, RolloutConfig(kernels="invariant")).kernels == "invariant"  # as configured: its own checks refuse it


# ------------------------------------------------------------------ caches keyed by the set that runs
def test_cost_entries_and_prefix_cache_are_keyed_by_the_set_that_runs(tiny_models, monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    model = tiny_models("tiny-qwen2")

    def keys(kernels: str) -> tuple[str, tuple]:
        config = RolloutConfig(kernels=kernels, prefix_cache_mb=1.0, persist_costs=False, compile=False)
        rollout = Rollout(model, None, config)
        rollout._prefix_cache()
        return entry_key(rollout.cost_source.metadata), rollout.prefix_cache.version

    auto, invariant, hf = keys("auto"), keys("invariant"), keys("torch")
    assert auto == invariant
    assert auto[0] != hf[0] and auto[1] != hf[1]  # negative control: the key does see the kernel set


def test_the_cost_probe_of_a_compiling_auto_rollout_runs_the_engine_set(tiny_models):
    """compile=True makes "auto" fall back to the model's own linears for the calls, while the cost probe
    decodes eagerly (compile off), where "auto" takes the engine's set: its packed weights are made on
    demand (the calls' own config packed none)."""
    rollout = Rollout(tiny_models("tiny-llama"), None, RolloutConfig(compile=True, persist_costs=False))
    assert rollout.kernel_choice.kernels == "auto" and rollout.packed_linears is None
    profile = rollout._probe_runner()("aligned", PROMPTS, SamplingConfig(max_new_tokens=2, eos_token_id=[]))
    assert profile.plan["linear"] == "cpu" and profile.packs_made > 0
