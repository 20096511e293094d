"""The parts of a Llama-family model the engine's decode step calls, read once per call."""

from __future__ import annotations

import sys
import weakref
from types import ModuleType
from typing import Any

import torch

from autobucket.engine.decode.eligibility import LLAMA_FAMILY, ineligible_reason

_ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


class LlamaParts:
    """A Llama, Qwen2, Qwen3 or Mistral causal LM's leaves, in its forward's order.

    `modeling` is the model's modeling module (its `apply_rotary_pos_emb`, looked up at each call as the
    model's attention looks it up). A sliding window is handed to the attention as the model's attention
    hands it: Mistral its config's, Qwen2/3 each layer's own (None on a full-attention layer)."""

    def __init__(self, model: torch.nn.Module, modeling: ModuleType, qk_norm: bool) -> None:
        # not the model itself: the record is kept per model (`of`) and must not keep it alive
        self.inner, self.lm_head, self.modeling, self.qk_norm = model.model, model.lm_head, modeling, qk_norm
        self.layers = list(self.inner.layers[: model.config.num_hidden_layers])
        self.window_from_config = type(model).__name__ == "MistralForCausalLM"
        # per layer: whether its attention hands a `sliding_window` keyword on (transformers 4.57 and 5.x)
        self.window_keyword = [
            self.window_from_config or hasattr(layer.self_attn, "sliding_window") for layer in self.layers
        ]
        self.linears = [
            *(getattr(part, name) for layer in self.layers
              for part, names in ((layer.self_attn, _ATTENTION_LINEARS), (layer.mlp, _MLP_LINEARS)) for name in names),
            self.lm_head,
        ]  # fmt: skip
        qk_norms = (
            [n for layer in self.layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)] if qk_norm else []
        )
        self.norms = [
            *(norm for layer in self.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)),
            *qk_norms,
            self.inner.norm,
        ]
        self.mlps = [layer.mlp for layer in self.layers]

    @classmethod
    def of(cls, model: torch.nn.Module) -> LlamaParts | None:
        """`model`'s parts, or None where only its own forward is exact (`ineligible_reason`, checked at
        each call). One record per model while it holds the same modules: a compiled step's guards then
        hold across calls."""
        if ineligible_reason(model) is not None:
            return None
        modeling = sys.modules[type(model).__module__]
        parts, kept = cls(model, modeling, LLAMA_FAMILY[type(model).__name__] == "Qwen3"), _PARTS.get(model)
        if kept is not None and kept.modules() == parts.modules():
            return kept
        _PARTS[model] = parts  # first call, or a module replaced (resized embeddings, a LoRA layer wrapped in)
        return parts

    def modules(self) -> list[torch.nn.Module]:
        """Every module the record holds (compared by identity: `nn.Module` has no other equality)."""
        return [self.inner, self.lm_head, *self.layers, *self.linears, *self.norms, *self.mlps]

    def layer_window(self, attention: Any) -> int | None:
        """The sliding window this layer's attention hands its attention function, as the model's reads it."""
        if self.window_from_config:
            return getattr(attention.config, "sliding_window", None)
        return getattr(attention, "sliding_window", None)


_PARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its parts
