"""The scope in which a forward runs the Triton kernel set: this thread's linears (`F.linear` and
transformers' `Conv1D` addmm calls, through `functions.py`) on the invariant linear, its attention
calls (through transformers' "sdpa" dispatcher) on the invariant attention, and a Llama-family model's
RMSNorms on the row kernel (`triton_norms.py`). Nothing on the model changes,
and other threads' forwards keep the builtins (the same interceptors as the CPU set's).

Which set a forward runs is the device's: CUDA tensors take this one, CPU tensors the C++ set, unless
`forced_on_cpu` (a test switch, under Triton's interpreter only) sends CPU tensors here too, so CPU CI runs
the very code a GPU runs. Forward values carry the guarantee; gradients are the ordinary ones (a linear's
GEMMs on the live weight, attention's recomputed by SDPA)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autobucket.engine.intercept.active import active, forward_with
from autobucket.engine.intercept.attention import kernel_attention
from autobucket.engine.intercept.functions import (
    linears_on,
    original_addmm,
    original_linear,
)
from autobucket.engine.intercept.triton_norms import norms_on_triton
from autobucket.engine.kernels.invariant_attention import allowed_for, attention_call, reference_attention
from autobucket.engine.kernels.triton.attention import causal_counts, invariant_attention, memoized_key_order
from autobucket.engine.kernels.triton.linear import invariant_linear
from autobucket.engine.kernels.triton.tiles import LINEAR_TILES, interpreting


@contextmanager
def forced_on_cpu() -> Iterator[None]:
    """Test switch: this thread's CPU models run the Triton set (under `TRITON_INTERPRET=1` only)."""
    if not interpreting():
        raise ValueError(
            "forced_on_cpu runs the Triton kernels on CPU tensors through Triton's interpreter: set "
            "TRITON_INTERPRET=1 before triton is imported"
        )
    with forward_with(triton_on_cpu=True):
        yield


def runs_triton_set(device: torch.device) -> bool:
    """Whether `kernels="invariant"` on a model on `device` runs the Triton set (else the C++ one)."""
    return device.type == "cuda" or (device.type == "cpu" and active().triton_on_cpu)


class TritonLinears:
    """The linear route (`functions.LinearKernel`) of the Triton set: every call on `invariant_linear`,
    on the weight where it lives (nothing to pack, so nothing goes stale after an optimizer step)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not _takes(x, weight, bias):
            return original_linear(x, weight, bias)
        return invariant_linear(x, weight, bias)

    def addmm(self, bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' `Conv1D`: `addmm(bias, x, weight)`, weight [K, N]: the linear of its transpose."""
        if not _takes(x, weight, bias):
            return original_addmm(bias, x, weight)
        return invariant_linear(x, weight.t(), bias)

    def ready_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return None  # no quick path: `linear` is already one op call


def _takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The kernel's calls: one dtype it has tiles for, on one device."""
    return (
        x.dtype in LINEAR_TILES
        and weight.dtype == x.dtype
        and x.device == weight.device
        and (bias is None or bias.dtype == x.dtype)
    )


class _Attention(torch.autograd.Function):
    """Forward values from the kernel; gradients from SDPA recomputed on the saved inputs."""

    @staticmethod
    def forward(ctx, query, key, value, order, count, allowed, causal, scale):  # type: ignore[override]
        ctx.save_for_backward(query, key, value, allowed)
        ctx.causal, ctx.scale = causal, scale
        return invariant_attention(query, key, value, order, count, scale)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        query, key, value, allowed = ctx.saved_tensors
        inputs = [
            t.detach().requires_grad_(need)
            for t, need in zip((query, key, value), ctx.needs_input_grad[:3], strict=True)
        ]
        with torch.enable_grad():
            output = reference_attention(*inputs, allowed, ctx.causal, ctx.scale)
            grads = iter(torch.autograd.grad(output, [t for t in inputs if t.requires_grad], grad_output))
        return *(next(grads) if t.requires_grad else None for t in inputs), None, None, None, None, None


def triton_attention(query, key, value, attention_mask, scale: float, causal: bool) -> torch.Tensor:
    """query [rows, heads, queries, D], key/value [rows, kv_heads, columns, D], a 4-D mask (bool or 0 / -inf)
    or None (causal or full) -> [rows, queries, heads, D]."""
    rows, queries, columns = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is None:
        order, count = None, causal_counts(rows, queries, columns, causal, query.device)
        allowed = allowed_for(None, rows, columns).to(query.device)
    else:
        allowed = allowed_for(attention_mask, rows, columns)
        order, count = memoized_key_order(allowed, attention_mask)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return _Attention.apply(query, key, value, order, count, allowed, causal, float(scale))
    return invariant_attention(query, key, value, order, count, float(scale))


def triton_sdpa(
    module: Any, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface over `triton_attention` (refusals as the CPU set's)."""
    scale, causal = attention_call(module, query, attention_mask, dropout, scaling, is_causal, kwargs)
    return triton_attention(query, key, value, attention_mask, scale, causal), None


@contextmanager
def triton_kernels(model: torch.nn.Module | None = None, conv1d: bool = False) -> Iterator[None]:
    """This thread's forwards in the block run their linears and attention on the Triton set, and
    `model`'s RMSNorms (Llama family) on its row kernel."""
    with linears_on(TritonLinears(), conv1d), kernel_attention(triton_sdpa), norms_on_triton(model):
        yield
