"""The model's RMSNorm on the Triton set's one-program-per-row kernel, inside the Triton scope.

torch's row reductions on a GPU pick their split by the shape, so the Llama family's RMSNorm
(`weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`) need not give a row the same bits in a decode step and
in a trainer's batch. Inside the scope the modeling file's RMSNorm class's `forward` is a router
(`elementwise.routes.routed`, as the CPU set's fused kernels are reached) that sends this thread's calls
to `row_reductions.rms_norm`; other threads, compiled graphs and other models run the class's own code."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from autobucket.engine.kernels.elementwise.routes import family_class, llama_modeling_module, routed
from autobucket.engine.kernels.triton.row_reductions import rms_norm
from autobucket.engine.kernels.triton.tiles import LINEAR_TILES
from autobucket.engine.model_access.function_routes import context_value

_NORMS_ROUTED: contextvars.ContextVar[bool] = contextvars.ContextVar("autobucket_triton_norms", default=False)


def _takes(module: torch.nn.Module, hidden: torch.Tensor) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor) and isinstance(getattr(module, "variance_epsilon", None), float)
        and hidden.dtype in LINEAR_TILES and weight.dtype == hidden.dtype and weight.shape == hidden.shape[-1:]
    )  # fmt: skip


def norm_router(builtin: Callable) -> Callable:
    def routed_rms_norm_forward(module, hidden_states, *args, **kwargs):
        if _NORMS_ROUTED.get() and not torch.compiler.is_compiling() and not (args or kwargs) and _takes(module, hidden_states):
            return rms_norm(hidden_states, module.weight, module.variance_epsilon)
        return builtin(module, hidden_states, *args, **kwargs)

    routed_rms_norm_forward._autobucket_builtin = builtin  # type: ignore[attr-defined]
    return routed_rms_norm_forward


@contextmanager
def norms_routed(model: torch.nn.Module | None) -> Iterator[None]:
    """This thread's calls of `model`'s RMSNorm class (Llama family) run the Triton kernel in the block."""
    modeling = llama_modeling_module(model) if model is not None else None
    norm_class = family_class(model, modeling, "RMSNorm") if modeling is not None else None
    if norm_class is None:
        yield
        return
    with routed(norm_class, "forward", modeling, norm_router), context_value(_NORMS_ROUTED, True):
        yield
