"""The batch-invariant linear: `x @ weight.T + bias` with one fixed tile per dtype.

Each output tile [BLOCK_M, BLOCK_N] walks K from 0 upwards in BLOCK_K steps into one fp32 accumulator (no
split-K, no tile choice by row count), so a row's value is the same whether it is alone or among thousands,
at any place in the batch. The weight is read where it lives, through its strides (no packed copy, so an
optimizer's in-place update is seen by the next call); the bias is added once, after the K loop."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autobucket.engine.kernels.triton.tiles import LinearTiles, interpreting, linear_tiles


@triton.jit
def linear_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, FP32_INPUTS: tl.constexpr, IN_ORDER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_at = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    w_at = w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]: weight.T's tile
    row_in, col_in = rows[:, None] < M, cols[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if IN_ORDER:  # the interpreter: a `while` over the runtime K (triton 3.6's interpreter breaks `range` there)
        k0 = 0
        while k0 < K:
            a = tl.load(x_at, mask=row_in & (ks[None, :] < K - k0), other=0.0).to(tl.float32)
            b = tl.load(w_at, mask=col_in & (ks[:, None] < K - k0), other=0.0).to(tl.float32)
            acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
            x_at += BLOCK_K * stride_xk
            w_at += BLOCK_K * stride_wk
            k0 += BLOCK_K
    else:
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(x_at, mask=row_in & (ks[None, :] < K - k0), other=0.0)
            b = tl.load(w_at, mask=col_in & (ks[:, None] < K - k0), other=0.0)
            if FP32_INPUTS:  # noqa: SIM108 (a constexpr branch, resolved when the kernel is compiled)
                acc = tl.dot(a, b, acc, input_precision="ieee")  # never TF32
            else:
                acc = tl.dot(a, b, acc)
            x_at += BLOCK_K * stride_xk
            w_at += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_in & col_in)


def launch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: LinearTiles | None = None,
    in_order: bool | None = None,
) -> torch.Tensor:
    """x [M, K], weight [N, K], bias [N] | None -> [M, N] in x's dtype. `tiles` and `in_order` are the tests'
    handles (a changed BLOCK_K is the negative control); callers leave them to the dtype and the device."""
    tiles = tiles or linear_tiles(x.dtype)
    in_order = interpreting() if in_order is None else in_order
    rows, columns = x.shape[0], weight.shape[0]
    out = torch.empty((rows, columns), dtype=x.dtype, device=x.device)
    if rows == 0 or columns == 0:
        return out
    grid = (triton.cdiv(rows, tiles.block_m), triton.cdiv(columns, tiles.block_n))
    linear_kernel[grid](
        x, weight, bias if bias is not None else x, out, rows, columns, x.shape[1],
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, FP32_INPUTS=x.dtype == torch.float32, IN_ORDER=in_order,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
    )  # fmt: skip
    return out


@torch.library.custom_op("autobucket_triton::linear", mutates_args=())
def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] | None -> [..., N]: `F.linear`'s values to rounding, and a row's
    bits independent of the other rows. Gradients are the ordinary GEMMs'."""
    flat = x.reshape(-1, x.shape[-1])
    return launch_linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])


@invariant_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    grad_weight = grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_weight, grad_bias


invariant_linear.register_autograd(_backward, setup_context=_setup_context)
