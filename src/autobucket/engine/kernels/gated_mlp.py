"""The Llama family's gated MLP with SiLU-and-multiply in one pass, for this thread's engine forwards.

`down_proj(act_fn(gate_proj(x)) * up_proj(x))` writes `silu(gate)`, a tensor of tokens x intermediate
floats, and reads it back for the product. `csrc/silu_and_mul.cpp` makes the product in one pass, element
by element as ATen's kernels compute it (the same Sleef `exp` in vector lanes, the same scalar tails, the
same split among threads), so it is bitwise `F.silu(gate) * up` (tested).

How the model's forward reaches it without a change to the model: while an engine call is in flight,
the modeling module's MLP class's `forward` is a router (`function_routes.function_replaced`) that runs
the same three linears, in the model's order, and the fused product for this thread's engine forwards
where it can take the call (fp32 CPU tensors, no gradient wanted, the activation transformers' own SiLU
with no hooks, ATen on its AVX-512 kernels), and the class's own forward otherwise: other threads,
autograd, compiled graphs. The direct decode step (`direct_decode.py`) counts the router as the
class's own forward and runs its MLPs through `gated_mlp_output` too."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autobucket.engine.kernels.rotary import kernel_library_builds, llama_modeling_module
from autobucket.engine.model_access.direct_decode import LLAMA_FAMILY
from autobucket.engine.model_access.function_routes import builtin_behind, context_value, function_replaced

_FUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("autobucket_fused_mlp", default=False)
_ENABLED = [True]  # the process's switch (`set_fused_mlp`), for benchmarks' A/B


def set_fused_mlp(enabled: bool) -> bool:
    """Turn the fused SiLU-and-multiply on or off for calls that start afterwards (benchmarks/rotary.py's
    A/B; the values are the same either way); returns the previous setting."""
    previous, _ENABLED[0] = _ENABLED[0], bool(enabled)
    return previous


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` in one pass (fp32, contiguous, one shape), bitwise the eager ops'."""
    return torch.ops.autobucket.silu_and_mul(gate, up)


@functools.cache
def _kernel_matches_aten() -> bool:
    """The fused op reproduces ATen's AVX-512 kernels: this build has it, and ATen runs those kernels
    (`ATEN_CPU_CAPABILITY` can lower them)."""
    return (
        kernel_library_builds()
        and torch.backends.cpu.get_cpu_capability() == "AVX512"
        and torch.ops.autobucket.silu_and_mul_available()
    )


def _plain_silu(act_fn: Any) -> bool:
    """`act_fn` is transformers' SiLU activation (or torch's), running its own forward, without hooks."""
    from transformers.activations import SiLUActivation

    return (
        type(act_fn) in (SiLUActivation, torch.nn.SiLU)
        and "forward" not in vars(act_fn)
        and not (act_fn._forward_hooks or act_fn._forward_pre_hooks)
        and not getattr(act_fn, "inplace", False)
    )


def _fusable(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return (
        gate.dtype == torch.float32 and up.dtype == torch.float32 and gate.device.type == "cpu"
        and gate.shape == up.shape and gate.is_contiguous() and up.is_contiguous()
        and not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))
    )  # fmt: skip


def gated_mlp_output(mlp: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The MLP's forward on `hidden`, with the fused product where this thread's engine call allows it:
    the linears in the model's order (gate, up, down), the same values either way."""
    # dynamo cannot read a context variable: a compiled graph traces the model's own expression
    if not torch.compiler.is_compiling() and _FUSED.get() and _plain_silu(mlp.act_fn):
        gate = mlp.gate_proj(hidden)
        up = mlp.up_proj(hidden)
        product = silu_and_mul(gate, up) if _fusable(gate, up) else mlp.act_fn(gate) * up
        return mlp.down_proj(product)
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(hidden)) * mlp.up_proj(hidden))


def _router(builtin: Callable) -> Callable:
    def forward(self, x):
        if not torch.compiler.is_compiling() and _FUSED.get():
            return gated_mlp_output(self, x)
        return builtin(self, x)

    forward.__name__ = forward.__qualname__ = "routed_forward"
    forward._autobucket_builtin = builtin  # type: ignore[attr-defined]
    return forward


@functools.cache
def _router_for(builtin: Callable) -> Callable:
    return _router(builtin)


@contextmanager
def fused_gated_mlp(model: torch.nn.Module) -> Iterator[None]:
    """This thread's forwards of `model` inside the block take the fused product in their MLPs where they
    can (see the module docstring); every other thread runs the class's own forward. Nothing of the model
    changes."""
    modeling = llama_modeling_module(model) if _ENABLED[0] else None
    mlp_class = getattr(modeling, f"{LLAMA_FAMILY.get(type(model).__name__)}MLP", None) if modeling else None
    builtin = builtin_behind(mlp_class.forward) if mlp_class is not None else None
    own = builtin is not None and getattr(builtin, "__module__", None) == modeling.__name__
    if not own or not _kernel_matches_aten():
        yield
        return
    with function_replaced(mlp_class, "forward", builtin, _router_for(builtin)), context_value(_FUSED, True):
        yield
