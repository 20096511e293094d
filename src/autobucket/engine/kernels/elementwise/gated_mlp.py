"""The Llama family's gated MLP with SiLU-and-multiply in one pass, for this thread's engine forwards.

`down_proj(act_fn(gate_proj(x)) * up_proj(x))` writes `silu(gate)`, a tensor of tokens x intermediate
floats, and reads it back for the product. `csrc/silu_and_mul.cpp` makes the product in one pass, element
by element as ATen's kernels compute it (the same Sleef `exp` in vector lanes, the same scalar tails, the
same split among threads), so it is bitwise `F.silu(gate) * up` (tested).

The MLP class's `forward` reaches it through a router (`routes.py`) that runs the same three linears in
the model's order and the fused product, where it can take the call: fp32 contiguous CPU tensors (in
bf16 the kernel is bitwise but was not faster), no gradient
wanted, the activation transformers' own SiLU with no hooks, ATen on the kernels of the width the library builds (AVX-512 or AVX2). The direct
decode step (`engine/decode/ops.py`) calls the class's `forward`, so it takes the router too."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from autobucket.engine.intercept.functions import call_linear
from autobucket.engine.intercept.modeling import calling_interceptor, is_interceptor, wants_grad
from autobucket.engine.kernels.library import kernel_library_builds


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` in one pass (fp32 or bf16, contiguous, one shape), bitwise the eager ops'."""
    return torch.ops.autobucket.silu_and_mul(gate, up)


@functools.cache
def available() -> bool:
    """The fused op reproduces ATen's kernels here: this library builds the form of the width ATen's
    kernels run (AVX-512 or AVX2; `ATEN_CPU_CAPABILITY` can lower ATen's below the library's, and then
    the eager ops run)."""
    if not kernel_library_builds():
        return False
    library_form = {512: "AVX512", 256: "AVX2"}.get(torch.ops.autobucket.vector_bits())
    return library_form is not None and torch.backends.cpu.get_cpu_capability() == library_form


@functools.cache
def _silu_classes() -> tuple[type, ...]:
    from transformers.activations import SiLUActivation

    return SiLUActivation, torch.nn.SiLU


def _plain_silu(act_fn: Any) -> bool:
    """`act_fn` is transformers' SiLU activation (or torch's), running its own forward, without hooks."""
    return (
        type(act_fn) in _silu_classes()
        and "forward" not in vars(act_fn)
        and not (act_fn._forward_hooks or act_fn._forward_pre_hooks)
        and not getattr(act_fn, "inplace", False)
    )


def _fusable(gate: torch.Tensor, up: torch.Tensor) -> bool:
    # fp32 only: the kernel is bitwise in bf16 too (tested), but no faster there (the bf16 temporaries
    # are half the traffic, and the exp dominates)
    return (
        gate.dtype == torch.float32 and up.dtype == gate.dtype and gate.device.type == "cpu"
        and gate.shape == up.shape and gate.is_contiguous() and up.is_contiguous() and not wants_grad(gate, up)
    )


def routed_module(mlp: Any) -> bool:
    """Whether the MLP class's forward on `mlp` (as the direct decode step calls it) runs `fused_forward`
    with the fused product for fp32 inputs: the router is in and the activation is the plain SiLU."""
    return is_interceptor(type(mlp).forward) and "forward" not in vars(mlp) and _plain_silu(mlp.act_fn)


def fused_forward(mlp: Any, hidden: torch.Tensor) -> Any:
    """The MLP's forward with the fused product: the linears in the model's order (gate, up, down), the
    same values as the class's forward."""
    if not _plain_silu(mlp.act_fn):
        return NotImplemented
    gate = call_linear(mlp.gate_proj, hidden)
    up = call_linear(mlp.up_proj, hidden)
    return call_linear(mlp.down_proj, silu_and_mul(gate, up) if _fusable(gate, up) else mlp.act_fn(gate) * up)


@functools.cache
def router_for(builtin: Callable) -> Callable:
    return calling_interceptor(builtin, fused_forward, "forward")
