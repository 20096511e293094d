"""transformers' rotary position embedding in one pass, for this thread's engine forwards.

A Llama-family attention layer rotates its queries and keys with its modeling module's
`apply_rotary_pos_emb`: `(q * cos) + (rotate_half(q) * sin)`, six passes over q and three temporaries
the size of q (two products, a negation and a concatenation, their sum). In a prefill of a few thousand
tokens that is most of the elementwise time outside the MLP; one fused pass reads q and writes the
result once (`benchmarks/kernels/fused_elementwise.py` times both). `csrc/rotary.cpp` computes the same expression per element, rounding
each product and the sum as the eager code does, so its outputs are bitwise the function's.

The modeling module's `apply_rotary_pos_emb` reaches it through a router (`routes.py`) for this thread's
engine forwards, where the kernel can take the call (fp32 or bf16 CPU tensors in the layouts it reads,
the default keywords, no gradient wanted: the trainer's forward with gradients keeps the eager code),
and only where the module's function agrees with the kernel bitwise on a probe."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from autobucket.engine.intercept.modeling import calling_interceptor, is_interceptor, wants_grad

NAME = "apply_rotary_pos_emb"
_DTYPES = (torch.float32, torch.bfloat16)


def fused_rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`apply_rotary_pos_emb(q, k, cos, sin)` on the kernel: q [B, H, T, D], k [B, Hk, T, D], cos and sin
    [B or 1, T, D] -> (q_embed, k_embed), bitwise the eager function's."""
    return torch.ops.autobucket.rotary_embedding(q, k, cos, sin)


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
    )
    layouts_fit = q.stride(3) == 1 and k.stride(3) == 1 and cos.stride(2) == 1 and cos.stride() == sin.stride()
    return shapes_fit and layouts_fit and not wants_grad(*tensors)


def routed(function: Any) -> bool:
    """Whether the modeling module's `apply_rotary_pos_emb` is this kernel's router."""
    return is_interceptor(function)


def fused_call(q, k, cos, sin, *args, **kwargs):
    if kernel_takes(q, k, cos, sin, args, kwargs):
        return fused_rotary_embedding(q, k, cos, sin)
    return NotImplemented


@functools.cache
def router_for(builtin: Callable) -> Callable | None:
    """The router in front of `builtin`, or None where `builtin` does not agree with the kernel bitwise on a
    probe in fp32 and bf16 (it is not the plain Llama-family function)."""
    generator = torch.Generator().manual_seed(0)
    for dtype in _DTYPES:
        # [batch 2, tokens 5, heads 3 / 1, head_dim 8] as the model lays them out: views transposed to [B, H, T, D]
        q = torch.randn(2, 5, 3, 8, generator=generator, dtype=torch.float32).to(dtype).transpose(1, 2)
        k = torch.randn(2, 5, 1, 8, generator=generator, dtype=torch.float32).to(dtype).transpose(1, 2)
        cos, sin = (torch.randn(2, 5, 8, generator=generator, dtype=torch.float32).to(dtype) for _ in range(2))
        with torch.inference_mode():
            want = builtin(q, k, cos, sin)
            got = fused_rotary_embedding(q, k, cos, sin)
        if not all(isinstance(w, torch.Tensor) and torch.equal(w, g) for w, g in zip(want, got, strict=True)):
            return None
    return calling_interceptor(builtin, fused_call, NAME)
