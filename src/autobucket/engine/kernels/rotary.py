"""transformers' rotary position embedding in one pass, for this thread's engine forwards.

A Llama-family attention layer rotates its queries and keys with its modeling module's
`apply_rotary_pos_emb`: `(q * cos) + (rotate_half(q) * sin)`, six passes over q and three temporaries
the size of q (two products, a negation and a concatenation, their sum). In a prefill of a few thousand
tokens that is most of the elementwise time outside the MLP (bench-qwen2, 2,000 tokens: 2.7 ms a layer
in fp32; the fused kernel 1.0). `csrc/rotary.cpp` computes the same expression per element, rounding
each product and the sum as the eager code does, so its outputs are bitwise the function's.

How the model's forward reaches it without a change to the model: while an engine call is in flight,
the modeling module's `apply_rotary_pos_emb` is a router (`function_routes.function_replaced`, as
`F.linear` is under the invariant kernels) that runs the fused kernel for this thread's engine forwards
where it can take the call, and the module's own function otherwise: other threads, autograd (the
trainer's forward with gradients keeps the eager code), compiled graphs, other dtypes, layouts or
arguments. The router goes in only for the Llama family's own modules (`direct_decode.LLAMA_FAMILY`)
and only where the module's function agrees bitwise with the kernel on a probe (a function someone
replaced, say a kernel library's, keeps running as it is)."""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autobucket.engine.kernels.invariant_attention import load_invariant_kernels
from autobucket.engine.model_access.direct_decode import LLAMA_FAMILY
from autobucket.engine.model_access.function_routes import builtin_behind, context_value, function_replaced

_FUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("autobucket_fused_rotary", default=False)
_ENABLED = [True]  # the process's switch (`set_fused_rotary`), for benchmarks' A/B
_DTYPES = (torch.float32, torch.bfloat16)
_NAME = "apply_rotary_pos_emb"


def fused_rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`apply_rotary_pos_emb(q, k, cos, sin)` on the kernel: q [B, H, T, D], k [B, Hk, T, D], cos and sin
    [B or 1, T, D] -> (q_embed, k_embed), bitwise the eager function's."""
    return torch.ops.autobucket.rotary_embedding(q, k, cos, sin)


def set_fused_rotary(enabled: bool) -> bool:
    """Turn the fused rotary on or off for calls that start afterwards (benchmarks/rotary.py's A/B; the
    values are the same either way); returns the previous setting."""
    previous, _ENABLED[0] = _ENABLED[0], bool(enabled)
    return previous


def kernel_takes(q: Any, k: Any, cos: Any, sin: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the kernel computes this call exactly as the eager function: the default keywords only,
    fp32 or bf16 CPU tensors of one dtype in the layouts the kernel reads, and no gradient wanted."""
    if args or any((name, value) not in (("unsqueeze_dim", 1), ("position_ids", None)) for name, value in kwargs.items()):
        return False
    tensors = (q, k, cos, sin)
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == q.dtype for t in tensors):
        return False
    if q.dtype not in _DTYPES or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    batch, _, tokens, head_dim = q.shape
    shapes_fit = (
        head_dim % 2 == 0 and k.shape[0] == batch and k.shape[2:] == q.shape[2:]
        and cos.shape[0] in (1, batch) and tuple(cos.shape[1:]) == (tokens, head_dim)
    )  # fmt: skip
    layouts_fit = q.stride(3) == 1 and k.stride(3) == 1 and cos.stride(2) == 1 and cos.stride() == sin.stride()
    return shapes_fit and layouts_fit and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _router(builtin: Callable) -> Callable:
    def routed(q, k, cos, sin, *args, **kwargs):
        if not torch.compiler.is_compiling() and _FUSED.get() and kernel_takes(q, k, cos, sin, args, kwargs):
            return fused_rotary_embedding(q, k, cos, sin)
        return builtin(q, k, cos, sin, *args, **kwargs)

    routed.__name__ = routed.__qualname__ = f"routed_{_NAME}"
    routed._autobucket_builtin = builtin  # type: ignore[attr-defined]
    return routed


@functools.cache
def kernel_library_builds() -> bool:
    """Whether the engine's kernel library builds here (a C++ compiler); else the eager code runs."""
    try:
        load_invariant_kernels()
    except ValueError:  # no compiler: the eager function runs; the build error reaches the kernels' callers
        return False
    return True


@functools.cache
def _router_for(builtin: Callable) -> Callable | None:
    """The router in front of `builtin`, or None where `builtin` does not agree with the kernel bitwise on a
    probe in fp32 and bf16 (it is not the plain Llama-family function)."""
    generator = torch.Generator().manual_seed(0)
    for dtype in _DTYPES:
        # [batch 2, tokens 5, heads 3 / 1, head_dim 8] as the model lays them out: views transposed to [B, H, T, D]
        q = torch.randn(2, 5, 3, 8, generator=generator).to(dtype).transpose(1, 2)
        k = torch.randn(2, 5, 1, 8, generator=generator).to(dtype).transpose(1, 2)
        cos, sin = (torch.randn(2, 5, 8, generator=generator).to(dtype) for _ in range(2))
        with torch.inference_mode():
            want = builtin(q, k, cos, sin)
            got = fused_rotary_embedding(q, k, cos, sin)
        if not all(isinstance(w, torch.Tensor) and torch.equal(w, g) for w, g in zip(want, got, strict=True)):
            return None
    return _router(builtin)


def llama_modeling_module(model: torch.nn.Module) -> Any | None:
    """The transformers modeling module of a Llama-family causal LM (whose attention calls the module's
    `apply_rotary_pos_emb`), else None."""
    name = type(model).__module__
    if type(model).__name__ not in LLAMA_FAMILY or not name.startswith("transformers.models."):
        return None
    return sys.modules.get(name)


@contextmanager
def fused_rotary(model: torch.nn.Module) -> Iterator[None]:
    """This thread's forwards of `model` inside the block rotate queries and keys on the fused kernel where
    it takes the call (see the module docstring); anything else, and every other thread, runs the model's
    own function. Nothing of the model changes."""
    modeling = llama_modeling_module(model) if _ENABLED[0] else None
    current = getattr(modeling, _NAME, None) if modeling is not None else None
    builtin = builtin_behind(current) if current is not None else None  # another call's router: its builtin
    # only the modeling file's own function is probed: a replacement (a kernel library's) is not called here
    own = builtin is not None and getattr(builtin, "__module__", None) == modeling.__name__
    router = _router_for(builtin) if own and kernel_library_builds() else None
    if router is None:
        yield
        return
    with function_replaced(modeling, _NAME, builtin, router), context_value(_FUSED, True):
        yield
