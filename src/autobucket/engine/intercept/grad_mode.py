"""Autograd off for the engine's work: `torch.inference_mode` (no version counters, no views tracked),
or plain `torch.no_grad` for a model whose own forward hooks need version counters.

FSDP2's unshard (`fully_shard`) preserves its parameters' version counters around the all-gather, which
inference tensors do not have: under inference mode its pre-forward hook raises. The choice is made once
per call from the model (`autograd_off_for`) and read by every engine function through this
thread's `active()` record, so the decorated prefill and decode functions follow it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from autobucket.engine.intercept.active import active, forward_with
from autobucket.engine.model_access.hf_compat import class_names

# Class names (not imports: torch.distributed may be absent) of wrappers that need version counters.
_VERSIONED_WRAPPERS = frozenset({"FSDPModule", "FullyShardedDataParallel"})

F = TypeVar("F", bound=Callable[..., Any])


def _mode() -> Any:
    return torch.no_grad() if active().plain_no_grad else torch.inference_mode()


def without_autograd(function: F) -> F:
    """Run `function` with autograd off, in the mode this thread's call chose."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _mode():
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def needs_version_counters(model: torch.nn.Module) -> bool:
    return any(class_names(module) & _VERSIONED_WRAPPERS for module in model.modules())


@contextmanager
def autograd_off_for(model: torch.nn.Module) -> Iterator[None]:
    """The call's autograd mode: inference mode, or no_grad for an FSDP-sharded model."""
    with forward_with(plain_no_grad=needs_version_counters(model)), _mode():
        yield
