"""What differs between transformers 4.57.x and 5.x, detected from the model, never guessed from a
version string: the forward's cache keyword (`cache=` in 5.x, `past_key_values=` before), the
output's cache field, and whether the forward accepts `logits_to_keep`; and `CacheLayerFace`, the per-layer
face every engine-owned transformers `Cache` gives the model (both versions query sizes per layer)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class ForwardSpec:
    """How to call one model's forward."""

    cache_keyword: str  # "cache" (transformers 5.x) or "past_key_values" (4.57)
    accepts_logits_to_keep: bool


def unwrap_model(model: Any) -> torch.nn.Module:
    """The HF causal LM whose forward the engine runs, from what a trainer hands over.

    Distributed and compile wrappers (DDP, DataParallel, DeepSpeed, FSDP, `torch.compile`) are removed as
    accelerate removes them (`extract_model_from_parallel`); a peft `PeftModel` gives its base model with
    the adapter layers injected (its forward runs the active adapters, unmerged), because `PeftModel.forward`
    does not take the cache keyword the engine passes. Nothing of the wrapper or the model is changed."""
    inner = model
    for _ in range(8):  # wrappers nest (a compiled PeftModel inside DDP); each pass removes one layer
        unwrapped = _unwrap_once(inner)
        if unwrapped is inner:
            break
        inner = unwrapped
    if not isinstance(inner, torch.nn.Module) or not hasattr(inner, "generation_config"):
        by_name = f"; to load {model!r} by name or path: autobucket.load_model({model!r})" if isinstance(model, str) else ""
        raise TypeError(
            f"model of type {type(model).__name__} is not a Hugging Face causal LM: pass a PreTrainedModel, a "
            f"peft PeftModel, or a DDP / FSDP / DeepSpeed / accelerate / torch.compile wrapper of one{by_name}"
        )
    return inner


def check_weights_loaded(model: torch.nn.Module) -> None:
    """A ValueError when a parameter is on the meta device (a model built under `init_empty_weights` or
    `device="meta"` whose weights were never loaded): nothing could run, and torch would fail mid-call."""
    name = next((name for name, parameter in model.named_parameters() if parameter.is_meta), None)
    if name is not None:
        raise ValueError(
            f"the model's parameter {name!r} is on the meta device (its weights were never loaded): load them "
            "first (from_pretrained, or load_state_dict(state, assign=True)) and pass the loaded model"
        )


def _unwrap_once(model: Any) -> Any:
    if _is_peft_model(model):
        _check_adapter_in_layers(model)
        return model.get_base_model()
    if _looks_wrapped(model):
        from accelerate.utils import extract_model_from_parallel

        unwrapped = extract_model_from_parallel(model, keep_fp32_wrapper=True, keep_torch_compile=False)
        if unwrapped is not model:
            return unwrapped
    if not hasattr(model, "generation_config") and hasattr(model, "module"):
        return model.module  # other wrappers that keep the model in `.module`
    return model


_WRAPPER_CLASSES = frozenset({
    "DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "DeepSpeedEngine", "OptimizedModule",
})  # fmt: skip


def _looks_wrapped(model: Any) -> bool:
    """A wrapper accelerate would remove. Checked first by class name because accelerate's unwrapping
    imports DeepSpeed when installed, which prints to stdout (a CLI writing JSON there must not see it)."""
    if not isinstance(model, torch.nn.Module):  # a str, say, has no vars()
        return False
    return bool(class_names(model) & _WRAPPER_CLASSES) or "_orig_mod" in vars(model)


def _check_adapter_in_layers(model: Any) -> None:
    """A ValueError for a prompt-learning adapter (prompt, prefix or p-tuning): `PeftModel.forward` adds its
    virtual tokens (or their K/V) to every input, outside the base model the engine runs, so the engine
    would generate as if the adapter were off, silently."""
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        method = getattr(config, "peft_type", None)
        raise ValueError(
            f"the PeftModel's active adapter {model.active_adapter!r} is {getattr(method, 'value', method)}, a "
            "prompt-learning method whose virtual tokens PeftModel.forward adds outside the base model, so "
            "autobucket would generate without them: use an adapter injected into the layers (LoRA, DoRA, "
            "IA3, LoHa, LoKr, ...), or the PeftModel's own generate"
        )


def _is_peft_model(model: Any) -> bool:
    return "PeftModel" in class_names(model) and hasattr(model, "get_base_model")


def class_names(obj: Any) -> set[str]:
    """The names of `obj`'s classes up its MRO: wrappers are recognised by name, so peft, DeepSpeed or
    torch.distributed are never imported for a model that is not theirs."""
    return {cls.__name__ for cls in type(obj).__mro__}


def forward_spec(model: torch.nn.Module) -> ForwardSpec:
    parameters = inspect.signature(model.forward).parameters
    if "cache" in parameters:
        keyword = "cache"
    elif "past_key_values" in parameters:
        keyword = "past_key_values"
    else:
        raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`")
    return ForwardSpec(cache_keyword=keyword, accepts_logits_to_keep="logits_to_keep" in parameters)


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the output head: the ids the model can emit (may exceed the tokenizer's vocabulary). A
    ZeRO-3 partitioned weight is empty outside its module's forward; its full shape is `ds_shape`."""
    weight = model.get_output_embeddings().weight
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def attention_backend(model: torch.nn.Module) -> str:
    """The model's attention implementation as transformers dispatches it now ("eager" when unset)."""
    return getattr(model.config, "_attn_implementation", None) or "eager"


def continuous_batching_refusal(model: torch.nn.Module) -> str | None:
    """Why the continuous-batching routes cannot run this model's attention (None: they can). Ordinary
    `generate` runs any backend transformers has (flash_attention_2, flex_attention, ...)."""
    implementation = attention_backend(model)
    if implementation in SUPPORTED_ATTENTION:
        return None
    return f"attn_implementation={implementation!r} is not supported by the continuous-batching routes"


def attention_implementation(model: torch.nn.Module) -> str:
    """The model's attention backend, refused with a ValueError where continuous batching cannot run it."""
    refusal = continuous_batching_refusal(model)
    if refusal is not None:
        raise ValueError(
            f"{refusal}: load the model with attn_implementation in {SUPPORTED_ATTENTION}, or use "
            "route='ordinary' (or route='auto', which runs ordinary generate for it)"
        )
    return attention_backend(model)


def output_cache(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def layer_key_values(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V `[batch, kv_heads, width, head_dim]` of a prefill's returned cache."""
    if hasattr(cache, "self_attention_cache"):  # EncoderDecoderCache wrapper (GPT-2 family)
        cache = cache.self_attention_cache
    if hasattr(cache, "layers"):
        return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
    return [k for k, _ in cache], [v for _, v in cache]  # legacy tuple of (k, v)


def full_prefill_cache(model: torch.nn.Module, spec: ForwardSpec) -> dict[str, Any]:
    """The cache keyword for a prefill forward: for a model with a sliding window, a DynamicCache of full
    layers (transformers' own keeps only a window's last keys per sliding layer, and the engine copies a
    prompt's whole K/V into its rows: the window is applied where attention runs); else nothing (the
    model makes its own)."""
    if sliding_window_limit(model.config) is None:
        return {}
    return {spec.cache_keyword: DynamicCache()}


def sliding_window_limit(config: Any) -> int | None:
    """The attention window when the model really uses one (the engine would ignore it), else None."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    uses_window = getattr(config, "use_sliding_window", True) and (
        "sliding_attention" in layer_types or not layer_types
    )
    return window if window and uses_window else None


class CacheLayerFace(CacheLayerMixin):
    """One model layer's face of an engine-owned transformers `Cache` (`owner`): transformers writes and
    queries sizes per layer, and the owner answers for every layer alike (its `update`, `get_mask_sizes`,
    `get_seq_length`, `get_max_cache_shape`). `compileable`: the owner runs inside a compiled graph.

    `_layer_type` stays unset: setting it would register this class in transformers' global maps."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: Cache, layer: int, compileable: bool = False) -> None:
        super().__init__()
        self.owner, self.layer = owner, layer
        self.is_compileable = compileable
        self.is_initialized = True

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.owner.update(key_states, value_states, self.layer)

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.owner.get_mask_sizes()

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return self.owner.get_max_cache_shape()

    def get_max_cache_shape(self) -> int:  # transformers 4.57 name
        return self.owner.get_max_cache_shape()
