"""Where the engine's Llama-family decode step may stand in for a model's forward.

The step (`step.py`) skips transformers' per-layer orchestration, so it is used only where nothing can
observe the difference: the model's exact classes from transformers (a subclass may override a forward)
with their own forwards (not replaced on the instance or the class, as instrumentation and kernel
libraries do), `"sdpa"` attention (the engine's dispatcher), no forward hooks on the modules it bypasses
(FSDP2 unshards, a distributed worker's cancel hook, a trainer's probes all live there) nor global ones,
and a transformers release the step was checked on. Anything else runs the model's own forward."""

from __future__ import annotations

import sys

import torch

from autobucket.engine.intercept.attention import dispatches
from autobucket.engine.intercept.functions import builtin_behind

# Causal LM class -> the prefix of its modeling module's classes; all share the Llama decoder layer's shape
# (pre-norm attention and gated MLP with residuals). Qwen3 adds per-head q/k RMSNorms before RoPE.
LLAMA_FAMILY = {
    "LlamaForCausalLM": "Llama",
    "Qwen2ForCausalLM": "Qwen2",
    "Qwen3ForCausalLM": "Qwen3",
    "MistralForCausalLM": "Mistral",
}

# The transformers releases whose Llama-family decoder layers the step was checked against, bitwise, by
# tests/engine/model_access/test_direct_decode.py (4.57.x, and 5.x up to this minor): a later release may reorder or add an
# op inside a layer, so there the model's forward runs until the tests pass on it and this is raised.
VERIFIED_TRANSFORMERS = ((4, 57), (5, 25))


def transformers_verified(version: str) -> bool:
    """Whether transformers `version` ("5.24.0", "4.57.6", "5.3.0.dev0") is one the step was checked on."""
    major, minor = (int(part) for part in version.split(".")[:2])
    low, high = VERIFIED_TRANSFORMERS
    return (major, minor) == low or (major == high[0] and minor <= high[1])


def installed_release_verified() -> bool:
    """Whether the transformers this process imports is a release the step was checked on (read at each
    call, so a test may change `transformers.__version__`)."""
    import transformers

    return transformers_verified(transformers.__version__)


def ineligible_reason(model: torch.nn.Module) -> str | None:
    """Why the engine's decode step cannot stand in for `model`'s forward (None: it can)."""
    import transformers

    if not installed_release_verified():
        return (f"transformers {transformers.__version__} is not a release the engine's decode step was checked on "
                f"({'.'.join(map(str, VERIFIED_TRANSFORMERS[0]))}.x, 5.x up to "
                f"{'.'.join(map(str, VERIFIED_TRANSFORMERS[1]))})")
    family = LLAMA_FAMILY.get(type(model).__name__)
    module_name = type(model).__module__
    if family is None or not module_name.startswith("transformers.models."):
        return f"{type(model).__name__} is not a transformers Llama, Qwen2, Qwen3 or Mistral causal LM"
    if not dispatches(model):
        return "its attention is not transformers' 'sdpa' (the engine's dispatcher)"
    modeling = sys.modules[module_name]
    expected = {
        "model": getattr(modeling, f"{family}Model", None),
        "layer": getattr(modeling, f"{family}DecoderLayer", None),
        "attention": getattr(modeling, f"{family}Attention", None),
        "mlp": getattr(modeling, f"{family}MLP", None),
    }
    inner = getattr(model, "model", None)
    if type(inner) is not expected["model"] or not hasattr(modeling, "apply_rotary_pos_emb"):
        return f"its base model is a {type(inner).__name__}, not transformers' {family}Model"
    for layer in inner.layers:
        parts = ((layer, "layer"), (layer.self_attn, "attention"), (layer.mlp, "mlp"))
        for module, kind in parts:
            if type(module) is not expected[kind]:
                return f"a {kind} is a {type(module).__name__}, not transformers' {expected[kind].__name__}"
    bypassed = [model, inner, *(m for layer in inner.layers for m in (layer, layer.self_attn, layer.mlp))]
    if any(_has_forward_hooks(module) for module in bypassed) or _global_forward_hooks():
        return "forward hooks are registered on modules whose forward it bypasses"
    patched = next((module for module in bypassed if _forward_replaced(module, module_name)), None)
    if patched is not None:  # instrumentation, a kernel library (Liger, unsloth) or a test's wrapper
        return f"{type(patched).__name__}.forward is not transformers' own (it was replaced)"
    return None


def _forward_replaced(module: torch.nn.Module, modeling_name: str) -> bool:
    """Whether `module`'s forward is another than its modeling file's: set on the instance, or on the class."""
    if "forward" in vars(module):
        return True
    # the engine's own router in front of the class's forward (function_routes.function_replaced) counts as it
    return getattr(builtin_behind(type(module).forward), "__module__", None) != modeling_name


def _has_forward_hooks(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _global_forward_hooks() -> bool:
    from torch.nn.modules import module as module_globals

    return bool(module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks)
