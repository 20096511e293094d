"""Position ids for a trainer's forward under `autobucket.invariant(model)` that passes none.

Generation counts positions over a row's real tokens (`prefill.positions_from_mask`: a left-padded
prompt's first token is position 0). Trainers score the rollout as one padded batch of left-padded
prompts + right-padded completions and pass only `input_ids` and `attention_mask` (TRL's
`_get_per_token_logps_and_entropies`, most PPO loops); most transformers models then count positions
from column 0, so a padded row's rotary angles (or learned position embeddings) are not the ones its
tokens were sampled with, and its logprobs are not the rollout's.

So inside the scope, a forward of the scoped model given a 2-D `attention_mask` with padding before a
real token in some row and no `position_ids` gets `positions_from_mask(mask)` for its tokens (the last
columns of the mask where a cache holds the first ones): for rotary models the same rotary function
as HF's own, for absolute-position models (GPT-2, OPT) the positions generation used. Given position
ids, masks without such padding, and 4-D or absent masks are left as they are.

How: a forward pre-hook on the causal LM (every wrapper's forward reaches it through `Module.__call__`:
peft, DDP, DeepSpeed), registered while a scope on it is open in any thread and removed when the last
closes. It acts only in threads (contexts) whose scope names this model, and never while dynamo traces
(a compiled graph of the engine's own forwards, which pass position ids). It changes no value of a
forward that passes position ids, which every engine forward does (`weight_versions` counts it
value-neutral for that reason)."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autobucket.engine.batching.prefill import positions_from_mask
from autobucket.engine.intercept.active import active, forward_with

_LOCK = threading.Lock()  # guards _HOOKS
_HOOKS: dict[int, list] = {}  # id(model) -> [its hook's handle, scopes open on it in all threads]


@contextmanager
def positions_over_real_tokens(model: torch.nn.Module) -> Iterator[None]:
    """This context's forwards of `model` inside the block that pass an attention mask with padding
    before real tokens and no position ids get position ids counted over the real tokens."""
    _hold_hook(model)
    try:
        with forward_with(position_models=active().position_models | {id(model)}):
            yield
    finally:
        _release_hook(model)


def _hold_hook(model: torch.nn.Module) -> None:
    with _LOCK:
        held = _HOOKS.get(id(model))
        if held is None:
            handle = model.register_forward_pre_hook(count_positions_over_real_tokens, with_kwargs=True)
            held = _HOOKS[id(model)] = [handle, 0]
        held[1] += 1


def _release_hook(model: torch.nn.Module) -> None:
    with _LOCK:
        held = _HOOKS[id(model)]
        held[1] -= 1
        if held[1] == 0:
            held[0].remove()
            del _HOOKS[id(model)]


def count_positions_over_real_tokens(
    module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    """The forward pre-hook: (args, kwargs) with position ids where the scope supplies them, else None
    (the call as it was)."""
    if torch.compiler.is_compiling() or id(module) not in active().position_models:
        return None
    positional, keywords = _forward_parameters(type(module))
    if "position_ids" not in keywords:
        return None
    given = dict(zip(positional, args, strict=False)) | kwargs  # positional ones first, as Python binds them
    if given.get("position_ids") is not None:
        return None
    mask = given.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not padding_before_tokens(mask):
        return None
    tokens = next((given[name] for name in ("input_ids", "inputs_embeds") if given.get(name) is not None), None)
    length = mask.shape[1] if tokens is None else tokens.shape[1]
    if length > mask.shape[1]:  # a mask shorter than the input: transformers' own error follows
        return None
    positions = positions_from_mask(mask)[:, mask.shape[1] - length :]  # [B, length]
    index = positional.index("position_ids") if "position_ids" in positional else len(args)
    if index < len(args):  # passed positionally as None
        return (*args[:index], positions, *args[index + 1 :]), kwargs
    return args, {**kwargs, "position_ids": positions}


def padding_before_tokens(mask: torch.Tensor) -> bool:
    """Whether a [B, T] mask has, in some row, a padding column before a real token (left padding, or a
    hole): there column counting and real-token counting differ for real tokens."""
    held = mask != 0
    return bool((held[:, 1:] & ~held[:, :-1]).any())


@functools.cache
def _forward_parameters(cls: type) -> tuple[list[str], set[str]]:
    """`cls.forward`'s parameters after `self`: those bound positionally, in order, and every named one."""
    parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional, {*positional, *(p.name for p in parameters if p.kind == p.KEYWORD_ONLY)}
