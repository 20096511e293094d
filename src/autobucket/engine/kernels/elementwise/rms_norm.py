"""The Llama family's RMSNorm in two passes over the hidden states instead of five, for this thread's
engine forwards.

`weight * (x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))` writes three temporaries the size of x.
`csrc/rms_norm.cpp` sums each row's squares in the order ATen's sum kernel adds them, rounds the
division by the row's length, `+ eps` and `rsqrt` on each row's variance as ATen's ops do (one rounded
division, one rounded add, 1 / sqrt), and applies the two products in one pass, all in one op call. So
the output is bitwise the module's (tested on row lengths with and without vector tails, eps values
that round differently in fp32, on 1 and 2 threads).

The RMSNorm class's `forward` reaches it through a router (`routes.py`) where it can take the call: fp32
or bf16 CPU tensors, contiguous, no gradient wanted, ATen on its AVX2 or AVX-512 kernels (whose sum is the same,
8-float vectors)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from autobucket.engine.intercept.modeling import calling_interceptor, is_interceptor, wants_grad
from autobucket.engine.kernels.library import kernel_library_builds


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The module's forward on contiguous `hidden` [..., H] and `weight` [H] (fp32, or bf16 computed in fp32
    as the module does), bitwise its values."""
    return torch.ops.autobucket.rms_norm(hidden, weight, eps)


@functools.cache
def available() -> bool:
    """The library builds the kernel (AVX2), and ATen's sum runs its 8-float vector kernel."""
    return (
        kernel_library_builds()
        and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        and torch.ops.autobucket.vector_bits() >= 256
    )


def _takes(norm: Any, hidden: Any) -> bool:
    weight = getattr(norm, "weight", None)
    return (
        isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)
        and hidden.dtype in (torch.float32, torch.bfloat16) and weight.dtype == hidden.dtype
        and hidden.device.type == "cpu"
        and hidden.dim() >= 1 and hidden.numel() > 0 and hidden.is_contiguous() and weight.is_contiguous()
        and weight.dim() == 1 and weight.shape[0] == hidden.shape[-1]
        and isinstance(getattr(norm, "variance_epsilon", None), float) and not wants_grad(hidden, weight)
    )


def routed_module(norm: Any) -> bool:
    """Whether `norm(hidden)` for contiguous fp32 hidden states reaches the kernel: its class's forward is
    the router and its weight and epsilon are what `_takes` wants."""
    weight = getattr(norm, "weight", None)
    return (
        is_interceptor(type(norm).forward) and isinstance(weight, torch.Tensor) and weight.dtype == torch.float32
        and weight.dim() == 1 and weight.is_contiguous() and isinstance(getattr(norm, "variance_epsilon", None), float)
    )


def fused_forward(norm: Any, hidden: Any) -> Any:
    if not _takes(norm, hidden):
        return NotImplemented
    return rms_norm(hidden, norm.weight, norm.variance_epsilon)


@functools.cache
def router_for(builtin: Callable) -> Callable:
    return calling_interceptor(builtin, fused_forward, "forward")
