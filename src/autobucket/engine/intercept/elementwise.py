"""The model's own elementwise code handed to the plan's functions: the Llama family's rotary embedding
(`apply_rotary_pos_emb`), its MLP's forward (SiLU-and-multiply) and its RMSNorm's forward.

`elementwise_on(model, functions)` puts an interceptor (`modeling.interceptor`) in front of the modeling
file's own code for each op in `functions` and records the functions on this thread's `active()`
record; `cpu_elementwise(model)` is what the engine's C++ kernels supply for `model` (each bitwise the
eager code's values) and `fused_elementwise(model)` runs them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from types import MappingProxyType
from typing import Any

import torch

from autobucket.engine.intercept.active import active, forward_with
from autobucket.engine.intercept.functions import builtin_behind
from autobucket.engine.intercept.modeling import family_class, intercepted, interceptor, llama_modeling_module
from autobucket.engine.kernels.elementwise import gated_mlp, rms_norm, rotary
from autobucket.engine.kernels.library import kernel_library_builds

ELEMENTWISE_OPS = ("rotary", "gated_mlp", "rms_norm")


def _site(model: torch.nn.Module, modeling: Any, op: str) -> tuple[Any, str] | None:
    """(owner, attribute) of the modeling code an op family replaces, or None where the model has none."""
    if op == "rotary":
        return (modeling, rotary.NAME) if hasattr(modeling, rotary.NAME) else None
    owner = family_class(model, modeling, "MLP" if op == "gated_mlp" else "RMSNorm")
    return None if owner is None else (owner, "forward")


def _own_code(modeling: Any, owner: Any, name: str) -> Callable | None:
    """The modeling file's own function behind `owner.name` (behind our interceptor, if one is in)."""
    builtin = builtin_behind(getattr(owner, name))
    return builtin if getattr(builtin, "__module__", None) == modeling.__name__ else None


def cpu_elementwise(model: torch.nn.Module) -> dict[str, Callable]:
    """op family -> the C++ kernel's function for `model`'s modeling code (Llama family, the kernel
    library built, the kernel agreeing with the modeling code), for the ops the kernels can run."""
    modeling = llama_modeling_module(model)
    if modeling is None or not kernel_library_builds():
        return {}
    functions: dict[str, Callable] = {}
    site = _site(model, modeling, "rotary")
    builtin = _own_code(modeling, *site) if site is not None else None
    if builtin is not None and rotary.router_for(builtin) is not None:  # bitwise agreement, probed once
        functions["rotary"] = rotary.fused_call
    if _site(model, modeling, "gated_mlp") is not None and gated_mlp.available():
        functions["gated_mlp"] = gated_mlp.fused_forward
    if _site(model, modeling, "rms_norm") is not None and rms_norm.available():
        functions["rms_norm"] = rms_norm.fused_forward
    return functions


@contextmanager
def elementwise_on(model: torch.nn.Module, functions: Mapping[str, Callable]) -> Iterator[None]:
    """This thread's forwards of a Llama-family `model` inside the block run `functions[op]` for each op
    family's modeling code (where the function takes the call); other models, other threads and ops
    not named run as they are. A function someone else put in the modeling module keeps running."""
    modeling = llama_modeling_module(model)
    if modeling is None or not functions:
        yield
        return
    with ExitStack() as stack:
        taken = {}
        for op, function in functions.items():
            site = _site(model, modeling, op)
            if site is None:
                continue
            owner, name = site
            attribute = rotary.NAME if op == "rotary" else "forward"
            stack.enter_context(intercepted(owner, name, modeling, lambda builtin, o=op, a=attribute: interceptor(builtin, o, a)))
            taken[op] = function
        stack.enter_context(forward_with(elementwise=MappingProxyType(taken)))
        yield


@contextmanager
def fused_elementwise(model: torch.nn.Module) -> Iterator[None]:
    """This thread's forwards of a Llama-family `model` inside the block run the rotary embedding, the
    MLP's SiLU-and-multiply and the RMSNorms on the C++ kernels where they can (bitwise the same values). Nothing of the model changes."""
    # an op an enclosing block already runs elsewhere (the Triton set's RMSNorm) stays there
    with elementwise_on(model, {**cpu_elementwise(model), **active().elementwise}):
        yield


def fused_here() -> bool:
    """Whether this thread's eager forward runs all three elementwise ops on the C++ kernels (the engine's
    kernel decode step then calls them directly)."""
    if torch.compiler.is_dynamo_compiling():
        return False
    functions = active().elementwise
    return (
        functions.get("rotary") is rotary.fused_call
        and functions.get("gated_mlp") is gated_mlp.fused_forward
        and functions.get("rms_norm") is rms_norm.fused_forward
    )
