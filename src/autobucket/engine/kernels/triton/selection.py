"""Token selection on the device, one program per row and one host read per step: greedy (the first
index of the row's maximum, as `torch.argmax`) and inverse-CDF sampling (the first index whose running
sum of weights passes u times the row's total, u the row's uniform; weights summed in column order)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autobucket.engine.kernels.triton.tiles import ROW_BLOCK


@triton.jit
def first_argmax_kernel(x_ptr, out_ptr, width, stride_x, BLOCK: tl.constexpr):
    row_ptr = x_ptr + tl.program_id(0) * stride_x
    best = tl.full((), float("-inf"), tl.float32)
    where = tl.zeros((), tl.int64)
    start = 0
    while start < width:
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        top = tl.max(x, axis=0)
        first = tl.min(tl.where(x == top, cols, width), axis=0).to(tl.int64)  # the block's first max
        better = top > best  # strictly: an equal max later keeps the earlier index
        where = tl.where(better, first, where)
        best = tl.where(better, top, best)
        start += BLOCK
    tl.store(out_ptr + tl.program_id(0), where)


@torch.library.custom_op("autobucket_triton::first_argmax", mutates_args=())
def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] (no NaN) -> int64 [rows]: each row's first maximum."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        first_argmax_kernel[(logits.shape[0],)](logits, out, logits.shape[1], logits.stride(0), BLOCK=ROW_BLOCK)
    return out


@first_argmax.register_fake
def _(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@triton.jit
def inverse_cdf_kernel(w_ptr, u_ptr, out_ptr, width, stride_w, BLOCK: tl.constexpr):
    """Two passes: the row's total, then the running sum up to the block that passes u * total."""
    row_ptr = w_ptr + tl.program_id(0) * stride_w
    sums = tl.zeros((BLOCK,), tl.float32)
    start = 0
    while start < width:
        cols = start + tl.arange(0, BLOCK)
        sums += tl.load(row_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
        start += BLOCK
    target = tl.load(u_ptr + tl.program_id(0)).to(tl.float32) * tl.sum(sums, axis=0)
    running = tl.zeros((), tl.float32)
    chosen = tl.full((), -1, tl.int64)
    last_positive = tl.zeros((), tl.int64)
    start = 0
    while start < width:
        cols = start + tl.arange(0, BLOCK)
        w = tl.load(row_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
        cdf = running + tl.cumsum(w, axis=0)
        passing = (cdf > target) & (w > 0)
        first = tl.min(tl.where(passing, cols, width), axis=0).to(tl.int64)
        chosen = tl.where((chosen < 0) & (first < width), first, chosen)
        last_positive = tl.maximum(last_positive, tl.max(tl.where(w > 0, cols, 0), axis=0).to(tl.int64))
        running += tl.sum(w, axis=0)
        start += BLOCK
    # rounding may leave the running sum just short of u * total: the last token with weight then
    tl.store(out_ptr + tl.program_id(0), tl.where(chosen < 0, last_positive, chosen))


def launch_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor, block: int = ROW_BLOCK) -> torch.Tensor:
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    out = torch.empty(weights.shape[0], dtype=torch.int64, device=weights.device)
    if weights.shape[0]:
        inverse_cdf_kernel[(weights.shape[0],)](
            weights, uniforms.contiguous(), out, weights.shape[1], weights.stride(0), BLOCK=block
        )
    return out


@torch.library.custom_op("autobucket_triton::sample_inverse_cdf", mutates_args=())
def sample_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """weights [rows, vocab] >= 0 (probabilities, unnormalised allowed), uniforms [rows] in [0, 1) ->
    int64 [rows]: the sampled token of each row."""
    return launch_inverse_cdf(weights, uniforms)


@sample_inverse_cdf.register_fake
def _(weights, uniforms):
    return weights.new_empty(weights.shape[0], dtype=torch.int64)
