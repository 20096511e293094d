"""Architectures beyond the six of the oracle suite (workloads.ARCHS), as RL trainers load them: each a tiny
random-weight config of the real transformers class, against single-request HF `generate` (greedy, EOS
off) on the continuous-batching routes with padded, per-prompt and packed prefill, both kernel sets.

What they add: per-head q/k norms (OLMo 2, Qwen3-MoE), mixture-of-experts MLPs (Qwen3-MoE, GraniteMoE),
sliding-window layer types inside the window (Gemma 3, Cohere 2), embedding and logit scaling (Gemma,
Granite), parallel attention/MLP blocks (GPT-NeoX, Phi, Falcon, Cohere 2), partial rotary (Phi, StableLM),
Llama 3 rope scaling, and the text side of vision-language classes (Gemma 3, Qwen2-VL, whose multimodal
rotary takes 1-D positions for text). A class this transformers release lacks is skipped by name; one
whose attention layers call torch's SDPA themselves (Falcon, StableLM on 4.57) packs prompts with a dense
mask, and `kernels="invariant"`, whose attention kernel it would never reach, refuses it by name."""

from __future__ import annotations

import pytest
import torch
from oracles import oracle_generate
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.engine.intercept.attention import uses_attention_interface

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_thread")]

_TEXT = {
    "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.2, "max_position_embeddings": 2048,
}  # fmt: skip
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # the classes' defaults lie outside 1,024 ids
_ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}  # fmt: skip

# name -> (model class, config class, config keywords)
ARCHITECTURES = {
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {**_TEXT, "head_dim": 16}),
    "gemma3-text": ("Gemma3ForCausalLM", "Gemma3TextConfig", {**_TEXT, "head_dim": 16, "sliding_window": 512,
                                                                "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {**_TEXT, **_IDS}),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", {**_TEXT, **_IDS}),
    "llama3-rope": ("LlamaForCausalLM", "LlamaConfig", {**_TEXT, "rope_scaling": _ROPE_LLAMA3}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {**_TEXT, "head_dim": 16, "num_experts": 4,
                                                            "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(_TEXT)),
    "granite-moe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", {**_TEXT, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", {**_TEXT, **_IDS}),
    "gpt-neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(_TEXT)),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(_TEXT)),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", dict(_TEXT)),
    "falcon": ("FalconForCausalLM", "FalconConfig", {**_TEXT, "num_kv_heads": 2, "new_decoder_architecture": True}),
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Config", {**_TEXT, **_IDS, "sliding_window": 512}),
}  # fmt: skip
ROUTES = {
    "equal_width": {"route": "equal_width"},
    "aligned": {"route": "aligned"},
    "packed": {"route": "bucketed", "costs": CostCoefficients(fixed_ms=1e4)},  # a high fixed cost packs
}
PROMPTS = random_prompts([5, 23, 11], seed=11)
NEW_TOKENS = 8
_MODELS: dict[str, torch.nn.Module] = {}


def build(name: str) -> torch.nn.Module:
    import transformers

    if name not in _MODELS:
        model_class, config_class, keywords = ARCHITECTURES[name]
        if not hasattr(transformers, model_class):
            pytest.skip(f"transformers {transformers.__version__} has no {model_class}")
        config = getattr(transformers, config_class)(**keywords)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = getattr(transformers, model_class)._from_config(config, attn_implementation="sdpa")
        _MODELS[name] = model.eval()
    return _MODELS[name]


@pytest.mark.parametrize("kernels", ["hf", "invariant"])
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_continuous_route_matches_hf_generate(name, kernels):
    model = build(name)
    if kernels == "invariant" and not uses_attention_interface(model):  # Falcon, StableLM on 4.57
        with pytest.raises(ValueError, match=r"attention layers call torch's SDPA themselves.*kernels='torch'"):
            Rollout(model, None, RolloutConfig(kernels=kernels))
        return
    expected = [oracle_generate(model, prompt, NEW_TOKENS, eos_token_id=[])[0] for prompt in PROMPTS]
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[])
    for route, keywords in ROUTES.items():
        result = Rollout(model, None, RolloutConfig(**keywords, kernels=kernels)).generate(PROMPTS, sampling)
        assert result.tokens == expected, f"{name} {kernels} {route}"
        if route == "packed":
            assert ["packed"] in result.profile.prefill_forms, result.profile.prefill_forms


def test_vision_language_classes_generate_text_as_their_own_generate_does():
    """Gemma 3 (4B and up) and Qwen2-VL load as ...ForConditionalGeneration: text prompts go through their
    language model (Qwen2-VL's multimodal rotary from text positions)."""
    import transformers

    text = {**_TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    configs = {
        "Qwen2VLForConditionalGeneration": transformers.Qwen2VLConfig(
            text_config=text, vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2},
            image_token_id=1000, video_token_id=1001, vision_start_token_id=1002, **_IDS),
        "Gemma3ForConditionalGeneration": transformers.Gemma3Config(
            text_config={**_TEXT, "head_dim": 16, "sliding_window": 512},
            vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                           "image_size": 28, "patch_size": 14},
            mm_tokens_per_image=4, image_token_index=1000, boi_token_index=1001, eoi_token_index=1002, **_IDS),
    }  # fmt: skip
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[])
    for class_name, config in configs.items():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = getattr(transformers, class_name)(config).eval()
        expected = [oracle_generate(model, prompt, NEW_TOKENS, eos_token_id=[])[0] for prompt in PROMPTS]
        for kernels in ("hf", "invariant"):
            result = Rollout(model, None, RolloutConfig(route="aligned", kernels=kernels)).generate(PROMPTS, sampling)
            assert result.tokens == expected, f"{class_name} {kernels}"
