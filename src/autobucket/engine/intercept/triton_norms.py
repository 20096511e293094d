"""The model's RMSNorm on the Triton set's one-program-per-row kernel.

torch's row reductions on a GPU pick their split by the shape, so the Llama family's RMSNorm
(`weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`) need not give a row the same bits in a decode step and
in a trainer's batch. `triton_rms_norm` is the Triton backend's "rms_norm" op: the RMSNorm class's
`forward` intercepted (`elementwise.elementwise_on`) reaches it for this thread's calls it takes; other
threads, compiled graphs and other models run the class's own code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autobucket.engine.intercept.active import active
from autobucket.engine.intercept.elementwise import elementwise_on
from autobucket.engine.kernels.triton.row_reductions import rms_norm
from autobucket.engine.kernels.triton.tiles import LINEAR_TILES


def _takes(module: torch.nn.Module, hidden: torch.Tensor) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and hidden.dtype in LINEAR_TILES
        and weight.dtype == hidden.dtype
        and weight.shape == hidden.shape[-1:]
    )


def triton_rms_norm(module: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
    """The RMSNorm forward on the row kernel, or NotImplemented where it cannot take the call."""
    if (args or kwargs) or not _takes(module, hidden_states):
        return NotImplemented
    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


@contextmanager
def norms_on_triton(model: torch.nn.Module | None) -> Iterator[None]:
    """This thread's calls of `model`'s RMSNorm class (Llama family) run the Triton kernel in the block."""
    if model is None:
        yield
        return
    with elementwise_on(model, {**active().elementwise, "rms_norm": triton_rms_norm}):
        yield
