"""How the model's own elementwise code reaches the fused kernels without a change to the model.

While an engine call is in flight, a function of the Llama family's modeling module, or the `forward`
of one of its classes, is an interceptor (`functions.function_replaced`, as `F.linear` is under the
invariant kernels) that sends this thread's engine forwards to a fused kernel where the kernel can take
the call, and everything else to the module's own code: other threads, autograd, compiled graphs (dynamo
cannot read a context variable, so a graph traces the model's own code), and inputs the kernel does not
take. Each kernel computes its expression exactly as the eager code rounds it, so the values are the
same either way (tested per kernel and on whole rollouts). Only the modeling file's own code intercepted:
a replacement someone else made (a kernel library's, a profiler's) keeps running as it is."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from autobucket.engine.decode.eligibility import LLAMA_FAMILY
from autobucket.engine.intercept.active import active
from autobucket.engine.intercept.functions import builtin_behind, function_replaced


def wants_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def llama_modeling_module(model: torch.nn.Module) -> Any | None:
    """The transformers modeling module of a Llama-family causal LM, else None."""
    name = type(model).__module__
    if type(model).__name__ not in LLAMA_FAMILY or not name.startswith("transformers.models."):
        return None
    return sys.modules.get(name)


def family_class(model: torch.nn.Module, modeling: Any, suffix: str) -> Any | None:
    """The modeling module's class `<Family><suffix>` ("MLP", "RMSNorm") for `model`, if it has one."""
    return getattr(modeling, f"{LLAMA_FAMILY[type(model).__name__]}{suffix}", None)


@contextmanager
def intercepted(owner: Any, name: str, modeling: Any, interceptor_for: Callable[[Callable], Callable | None]) -> Iterator[None]:
    """`owner.name` (a modeling module's function or one of its classes' `forward`) is the interceptor
    `interceptor_for(builtin)` inside the block, where the builtin is the modeling file's own code and
    `interceptor_for` accepts it (returns an interceptor); otherwise nothing changes."""
    current = getattr(owner, name, None)
    builtin = builtin_behind(current) if current is not None else None  # another call's interceptor: its builtin
    own = builtin is not None and getattr(builtin, "__module__", None) == modeling.__name__
    interceptor = interceptor_for(builtin) if own else None
    if interceptor is None:
        yield
        return
    with function_replaced(owner, name, builtin, interceptor):
        yield


def is_interceptor(function: Any) -> bool:
    """Whether `function` is one of these interceptors (the fused scope put it in front of the model's code)."""
    return getattr(function, "_autobucket_builtin", None) is not None


def interceptor(builtin: Callable, op: str, name: str) -> Callable:
    """An interceptor in front of `builtin` for the op family `op`: the function this thread's forward
    runs for `op` (`active().elementwise`; it returns NotImplemented where it cannot take the call), else
    `builtin(*args)`: other threads, compiled graphs and calls the function does not take."""
    return _interceptor(builtin, lambda functions: functions.get(op), name)


def calling_interceptor(builtin: Callable, fused: Callable, name: str) -> Callable:
    """An interceptor in front of `builtin` that calls `fused(*args)` where this thread's forward runs
    that very function for one of its ops (it returns NotImplemented where its kernel cannot take the
    call), `builtin(*args)` otherwise."""
    return _interceptor(builtin, lambda functions: fused if fused in functions.values() else None, name)


def _interceptor(builtin: Callable, pick: Callable[[Mapping[str, Callable]], Callable | None], name: str) -> Callable:
    """`builtin` fronted by what `pick` chooses from this thread's elementwise functions (None: the builtin)."""

    def routed_call(*args, **kwargs):
        # `is_dynamo_compiling`: `is_compiling()` is True for every thread while any thread compiles
        if not torch.compiler.is_dynamo_compiling():
            replacement = pick(active().elementwise)
            if replacement is not None:
                result = replacement(*args, **kwargs)
                if result is not NotImplemented:
                    return result
        return builtin(*args, **kwargs)

    routed_call.__name__ = routed_call.__qualname__ = f"routed_{name}"
    routed_call._autobucket_builtin = builtin  # type: ignore[attr-defined]
    return routed_call
