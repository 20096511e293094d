"""The engine's own attention, chosen per forward without touching the trainer's model.

autobucket runs inside the trainer's process, on the trainer's own model, so the model's state is shared
with other threads (an async trainer step, an evaluation loop, a reward model on the same backbone).
Writing `model.config._attn_implementation` for the length of a forward — what transformers' dispatch
reads — would make those threads' forwards run the engine's attention. Instead:

- one dispatcher replaces transformers' registered `"sdpa"` attention function, process-wide. It looks up
  the attention the *current forward* asked for and otherwise calls the function it replaced with the
  same arguments, so every other forward is bit-for-bit what it was (tested from a second thread);
- the engine asks for its attention through this thread's `active()` record (`engine_attention`), which
  is per thread and per asyncio task, for eager forwards; compiled graphs cannot read context variables, so the
  compiled decode step passes the function as a forward keyword (`ATTENTION_KEYWORD`) that transformers
  hands down to the attention call on the architectures that forward `**kwargs` (Llama, Qwen, Mistral
  families); elsewhere the compiled step runs transformers' own SDPA, which is equally exact.

Models loaded with `attn_implementation="eager"` never reach the registry (their layers call
`eager_attention_forward` directly); the engine then uses masks only (dense block-diagonal packing).

`eval_semantics` gives the engine's forwards eval behaviour on a model left in `train()` mode (dropout
off) without flipping its training flag, which another thread's training step reads."""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autobucket.engine.intercept.active import active, forward_with
from autobucket.engine.intercept.functions import dropout_off
from autobucket.engine.model_access.hf_compat import attention_backend

AttentionFunction = Callable[..., tuple[torch.Tensor, Any]]
ATTENTION_KEYWORD = "autobucket_attention"  # forward kwarg carrying the engine's attention into a graph

_HF_SDPA: AttentionFunction | None = None  # the function the dispatcher replaced


def hf_sdpa() -> AttentionFunction:
    """transformers' own SDPA attention (what a model configured for "sdpa" runs outside the engine)."""
    install_dispatcher()
    assert _HF_SDPA is not None
    return _HF_SDPA


def base_attention() -> AttentionFunction:
    """The attention kernel this thread's forward runs on: the invariant kernel inside `kernel_attention`,
    else transformers' own SDPA."""
    return active().kernel_attention or hf_sdpa()


def kernel_attention_active() -> bool:
    """Whether this thread's forwards run on the engine's own attention kernel (`kernels="invariant"`)."""
    return active().kernel_attention is not None


def chosen_attention() -> AttentionFunction | None:
    """What `dispatch_sdpa` calls for this thread's eager forward now: the engine's attention, else the
    kernel attention, else None (transformers' SDPA)."""
    forward = active()
    return forward.step_attention or forward.kernel_attention


def dispatch_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' attention-function interface: the attention this forward asked for (a forward
    keyword, else this thread's engine or kernel attention), else transformers' own SDPA. Registered as
    "sdpa"; the engine's decode step (`engine/decode/ops.py`) calls it as the model's attention would (only for
    models that `dispatches` accepted, so the dispatcher is installed by then)."""
    chosen = kwargs.pop(ATTENTION_KEYWORD, None)
    # under dynamo's trace only (`is_compiling()` is True for every thread while any thread compiles)
    if chosen is None and not torch.compiler.is_dynamo_compiling():
        forward = active()
        chosen = forward.step_attention or forward.kernel_attention
        window = kwargs.get("sliding_window")
        if window and forward.windows and not _is_placeholder(attention_mask):
            attention_mask = within_window(attention_mask, window, query.shape[2], key.shape[2], query.device)
    if chosen is None:
        return _HF_SDPA(module, query, key, value, attention_mask, *args, **kwargs)
    return chosen(module, query, key, value, attention_mask, *args, **kwargs)


@contextmanager
def sliding_windows_applied() -> Iterator[None]:
    """This thread's forwards in the block attend within each layer's sliding window (`dispatch_sdpa`): for
    a call whose sequences outgrow the window, the masks the engine builds cover a row's whole sequence."""
    install_dispatcher()
    with forward_with(windows=True):
        yield


def windows_applied() -> bool:
    """Whether this thread's forwards attend within their layers' sliding windows now."""
    return active().windows


_PLACEHOLDER = "_autobucket_placeholder"  # an attribute on masks that stand for none (`placeholder_mask`)


def placeholder_mask(mask: torch.Tensor) -> torch.Tensor:
    """Mark a mask the attention it reaches ignores (packed segments' stand-in: each segment attends
    causally on its own), so the dispatcher does not window it; its windows are the segments' own."""
    setattr(mask, _PLACEHOLDER, True)
    return mask


def _is_placeholder(mask: torch.Tensor | None) -> bool:
    return getattr(mask, _PLACEHOLDER, False)


class _WindowMemo(threading.local):
    """A forward hands every layer the same mask: its windowed form is kept for the next layer (keyed on
    the mask object, its version and the window; inference tensors keep no version: identity alone)."""

    source: weakref.ref | None = None
    key: tuple | None = None
    mask: torch.Tensor | None = None


_WINDOW_MEMO = _WindowMemo()


def within_window(
    mask: torch.Tensor | None, window: int, queries: int, keys: int, device: torch.device
) -> torch.Tensor | None:
    """`mask` `[rows | 1, 1, queries, keys]` (bool, True = attend; or additive, 0 = attend) narrowed to each
    query's `window` newest allowed keys, in its own type: the keys a row may see are its own sequence up
    to the query, in position order, so the k-th newest allowed key is k - 1 positions back (HF's window:
    key positions in (q - window, q]). No mask means causal with the queries last."""
    if mask is None:
        if keys <= window:
            return None
        query_column = torch.arange(keys - queries, keys, device=device)[:, None]
        key_column = torch.arange(keys, device=device)[None, :]
        return ((key_column <= query_column) & (key_column > query_column - window))[None, None]
    memo, memo_key = _WINDOW_MEMO, (None if mask.is_inference() else mask._version, window)
    if memo.source is not None and memo.source() is mask and memo.key == memo_key:
        return memo.mask
    allowed = mask if mask.dtype == torch.bool else mask == 0
    newer = allowed.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)  # allowed keys at or after each column
    keep = allowed & (newer <= window)
    windowed = keep if mask.dtype == torch.bool else mask.masked_fill(~keep, torch.finfo(mask.dtype).min)
    memo.source, memo.key, memo.mask = weakref.ref(mask), memo_key, windowed
    return windowed


def install_dispatcher() -> None:
    """Put `dispatch_sdpa` in front of transformers' registered "sdpa" function (once per process)."""
    global _HF_SDPA
    if _HF_SDPA is not None:
        return
    from transformers import AttentionInterface

    registered = AttentionInterface._global_mapping["sdpa"]
    if registered is not dispatch_sdpa:
        _HF_SDPA = registered
        AttentionInterface.register("sdpa", dispatch_sdpa)


def dispatches(model: torch.nn.Module) -> bool:
    """Whether this model's attention layers go through the dispatcher: configured for SDPA, and written
    against transformers' attention interface."""
    install_dispatcher()
    return attention_backend(model) == "sdpa" and uses_attention_interface(model)


_INTERFACE_USERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> uses_attention_interface


def uses_attention_interface(model: torch.nn.Module) -> bool:
    """Whether every attention layer's modeling file calls attention through transformers' registry. Some
    classes of a release call torch's SDPA themselves (Falcon and StableLM on 4.57; 5.x moved them to the
    registry): the dispatcher, and so the engine's attention, never sees their forwards."""
    if model not in _INTERFACE_USERS:
        # torch's own modules (a vision tower's nn.MultiheadAttention pooling head) are not modeling files
        modeling_files = {
            type(module).__module__
            for module in model.modules()
            if "Attention" in type(module).__name__ and not type(module).__module__.startswith("torch.")
        }
        _INTERFACE_USERS[model] = all(
            hasattr(sys.modules.get(name), "ALL_ATTENTION_FUNCTIONS") for name in modeling_files
        )
    return _INTERFACE_USERS[model]


@contextmanager
def engine_attention(function: AttentionFunction) -> Iterator[None]:
    """Run this thread's (task's) forwards inside the block through `function`; other threads are untouched."""
    install_dispatcher()
    with forward_with(step_attention=function):
        yield


@contextmanager
def kernel_attention(function: AttentionFunction) -> Iterator[None]:
    """This thread's forwards inside the block run their attention on `function` (the invariant kernel),
    including the engine's own attention (packed segments) built on `base_attention()`."""
    install_dispatcher()
    with forward_with(kernel_attention=function):
        yield


# ------------------------------------------------------------------ eval semantics on a training model
@contextmanager
def eval_semantics(model: torch.nn.Module) -> Iterator[None]:
    """Forwards inside the block behave as in `model.eval()` (no dropout: this thread's dropout calls
    returning their input, `functions.dropout_off`), without writing `model.training`. A model
    already in eval mode pays nothing."""
    if not any(module.training for module in model.modules()):
        yield
        return
    with dropout_off():
        yield


# ------------------------------------------------------------------ gradient checkpointing in train mode
@contextmanager
def checkpointing_layers_kept_cached(model: torch.nn.Module) -> Iterator[None]:
    """transformers drops the KV cache where gradient checkpointing is on in train mode — per layer on 4.57
    (5.x keeps it without gradients), per model in 5.x's GPT-2 family (`cache if not (gradient_checkpointing
    and training)`), even under inference mode. So for the call, and only on the modules with gradient
    checkpointing on and in train mode, the training flag is cleared and restored after (even on error).
    This is the one write a call makes, and it changes no values another thread computes: on those
    modules the flag only decides whether activations are recomputed in backward (dropout belongs to their
    submodules, whose flags are untouched)."""
    modules = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True and m.training]
    for module in modules:
        module.training = False
    try:
        yield
    finally:
        for module in modules:
            module.training = True
