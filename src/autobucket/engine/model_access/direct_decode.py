"""A decode step that runs the model's own parts without transformers' per-layer orchestration.

A continuous-batching decode step of a small model spends a share of its time in transformers' Python
between kernels (module calls, kwargs plumbing, output capture, mask preprocessing, config attribute
hooks, the cache interface, per layer), a share that grows as the kernels get faster.

For the Llama family (Llama, Qwen2, Qwen3, Mistral; SmolLM2 is a Llama) `DirectDecode.step` calls the
model's *leaf* parts — embedding, rotary embedding, RMSNorms, linears (LoRA layers included, so the active
adapters run), the model's own `apply_rotary_pos_emb` and its MLP class's forward — in the order and with the
tensor shapes of the model's forward, and attends through the same dispatcher the model's attention
reaches (`attention.dispatch_sdpa`: the engine's kernel for this thread, else transformers' SDPA). Every
value is therefore bitwise what `model(...)` computes on the same kernels (tested per architecture, dtype
and kernel set; a step that rotates only the keys is the negative control); only the orchestration is
ours, and it is small enough to read against the model's source. It pays on short calls of small
models, most with the invariant kernels, and is within noise where prefill or many layers of kernels
dominate (benchmarks/studies/direct_decode.py).

What it skips must not matter, so it is used only where nothing can observe the difference: the model's
exact classes from transformers (a subclass may override a forward) with their own forwards (not replaced
on the instance or the class, as instrumentation and kernel libraries do), `"sdpa"` attention (the
dispatcher), and no forward hooks on the modules it bypasses (FSDP2 unshards, a
distributed worker's cancel hook, a trainer's probes all live there) nor global ones. Anything else runs
the model's own forward. Nothing of the model is changed. A sliding window is handed to the dispatcher
as the model's attention hands it (Mistral: its config's; Qwen2/3: each layer's own, None on a full
layer), so a call past the window is narrowed there exactly as in the model's forward."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from autobucket.engine.intercept.attention import dispatch_sdpa, dispatches
from autobucket.engine.intercept.functions import builtin_behind, call_linear

# Causal LM class -> the prefix of its modeling module's classes; all share the Llama decoder layer's shape
# (pre-norm attention and gated MLP with residuals). Qwen3 adds per-head q/k RMSNorms before RoPE.
LLAMA_FAMILY = {
    "LlamaForCausalLM": "Llama",
    "Qwen2ForCausalLM": "Qwen2",
    "Qwen3ForCausalLM": "Qwen3",
    "MistralForCausalLM": "Mistral",
}

KeyValueWrite = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class DirectDecode:
    """One decode forward of a Llama-family model from its parts (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, modeling: ModuleType, qk_norm: bool) -> None:
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers[: model.config.num_hidden_layers])
        self.modeling = modeling  # the model's modeling module (its `apply_rotary_pos_emb`)
        self.qk_norm = qk_norm
        # The keywords the model's attention hands its attention function besides the mask (transformers
        # 4.57 and 5.x alike: the decoder layer's `position_ids` and `use_cache`; Qwen2/3 and Mistral add
        # their window: Mistral its config's, Qwen2/3 the layer's own, None on a full-attention layer).
        # Through it the dispatcher narrows a sliding layer's mask when a call outgrows the window.
        self.window_from_config = type(model).__name__ == "MistralForCausalLM"
        self.window_keyword = [
            self.window_from_config or hasattr(layer.self_attn, "sliding_window") for layer in self.layers
        ]

    @classmethod
    def of(cls, model: torch.nn.Module) -> DirectDecode | None:
        """The direct step for `model`, or None where only the model's own forward is exact (see
        `ineligible_reason`)."""
        if ineligible_reason(model) is not None:
            return None
        modeling = sys.modules[type(model).__module__]
        return cls(model, modeling, LLAMA_FAMILY[type(model).__name__] == "Qwen3")

    def apply_rotary(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The modeling module's `apply_rotary_pos_emb`, looked up at each call as the model's attention
        looks it up: while a call is in flight that is the fused rotary's router (`kernels/elementwise`),
        whenever the step was built."""
        return self.modeling.apply_rotary_pos_emb(query, key, cos, sin)

    def step(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        write: KeyValueWrite,
    ) -> torch.Tensor:
        """input_ids, position_ids [rows, 1]; attention_mask: the 4-D additive mask the model's forward would
        be given (it passes a 4-D mask through unchanged), or None where no row is masked; `write(layer, key,
        value)` stores a layer's new K/V [rows, kv_heads, 1, head_dim] and returns the layer's K/V up to
        them. -> logits [rows, 1, vocab] in the model's dtype."""
        inner = self.inner
        hidden = inner.embed_tokens(input_ids)  # [rows, 1, hidden]
        position_embeddings = inner.rotary_emb(hidden, position_ids)
        for index, layer in enumerate(self.layers):
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            hidden = self._attention(index, layer.self_attn, hidden, position_embeddings, attention_mask,
                                     position_ids, write)
            hidden = residual + hidden
            residual = hidden
            hidden = layer.post_attention_layernorm(hidden)
            # the class's forward: transformers' own, or the fused product's router in front of it (kernels/elementwise)
            hidden = type(layer.mlp).forward(layer.mlp, hidden)
            hidden = residual + hidden
        hidden = inner.norm(hidden)
        return call_linear(self.model.lm_head, hidden[:, 0:, :])  # the model slices `logits_to_keep=0` the same way

    def layer_window(self, attention: Any) -> int | None:
        """The sliding window this layer's attention hands its attention function, as the model's reads it."""
        if self.window_from_config:
            return getattr(attention.config, "sliding_window", None)
        return getattr(attention, "sliding_window", None)

    def _attention(
        self,
        index: int,
        attention: Any,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        write: KeyValueWrite,
    ) -> torch.Tensor:
        input_shape = hidden.shape[:-1]
        hidden_shape = (*input_shape, -1, attention.head_dim)  # [rows, 1, heads, head_dim]
        # The projections in the model's order (a fused group learns its members from that order).
        if self.qk_norm:
            query = attention.q_norm(call_linear(attention.q_proj, hidden).view(hidden_shape)).transpose(1, 2)
            key = attention.k_norm(call_linear(attention.k_proj, hidden).view(hidden_shape)).transpose(1, 2)
        else:
            query = call_linear(attention.q_proj, hidden).view(hidden_shape).transpose(1, 2)
            key = call_linear(attention.k_proj, hidden).view(hidden_shape).transpose(1, 2)
        value = call_linear(attention.v_proj, hidden).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = self.apply_rotary(query, key, cos, sin)
        key, value = write(attention.layer_idx, key, value)
        keywords: dict[str, Any] = {"position_ids": position_ids, "use_cache": True}
        if self.window_keyword[index]:
            keywords["sliding_window"] = self.layer_window(attention)
        output, _ = dispatch_sdpa(
            attention, query, key, value, attention_mask,
            dropout=0.0 if not attention.training else attention.attention_dropout,
            scaling=attention.scaling, **keywords,
        )
        output = output.reshape(*input_shape, -1).contiguous()
        return call_linear(attention.o_proj, output)


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
    """Why the direct step cannot stand in for `model`'s forward (None: it can)."""
    import transformers

    if not installed_release_verified():
        return (f"transformers {transformers.__version__} is not a release the direct step was checked on "
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
