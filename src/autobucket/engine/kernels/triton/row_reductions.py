"""The row reductions of a forward and of trainer logprobs, one program per row: RMSNorm (the Llama
family's, `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`), and logsumexp / log_softmax at a token over
a row of logits. A row's sum runs in the same blocks and order whatever the number of rows, so its bits
are the row's alone (torch's reductions pick a split by the shape)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autobucket.engine.kernels.triton.tiles import ROW_BLOCK


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, width, eps, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / width
    normed = (x * (1.0 / tl.sqrt(variance + eps))).to(out_ptr.dtype.element_ty)
    weight = tl.load(w_ptr + cols, mask=inside, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=inside)


@torch.library.custom_op("autobucket_triton::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] (x's dtype) -> [..., H], the row in one block."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(flat)
    if flat.shape[0]:
        width = flat.shape[1]
        rms_norm_kernel[(flat.shape[0],)](
            flat, weight, out, width, float(eps), flat.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(width)
        )
    return out.view(x.shape)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, grad):
    """The gradients of the same formula in torch (only the forward values carry the guarantee)."""
    x, weight = ctx.saved_tensors
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    with torch.enable_grad():
        variance = x.float().pow(2).mean(-1, keepdim=True)
        out = weight * (x.float() * torch.rsqrt(variance + ctx.eps)).to(x.dtype)
        grad_x, grad_weight = torch.autograd.grad(out, (x, weight), grad)
    return grad_x, grad_weight, None


rms_norm.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


@triton.jit
def logsumexp_kernel(x_ptr, out_ptr, width, stride_x, BLOCK: tl.constexpr):
    """Two passes over the row in BLOCK steps: its max, then the sum of exp(x - max)."""
    row_ptr = x_ptr + tl.program_id(0) * stride_x
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    start = 0
    while start < width:
        cols = start + tl.arange(0, BLOCK)
        best = tl.maximum(best, tl.load(row_ptr + cols, mask=cols < width, other=float("-inf")).to(tl.float32))
        start += BLOCK
    top = tl.max(best, axis=0)
    sums = tl.zeros((BLOCK,), tl.float32)
    start = 0
    while start < width:
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        sums += tl.exp(x - top)
        start += BLOCK
    tl.store(out_ptr + tl.program_id(0), top + tl.log(tl.sum(sums, axis=0)))


def launch_logsumexp(logits: torch.Tensor, block: int = ROW_BLOCK) -> torch.Tensor:
    """logits [rows, vocab] -> fp32 [rows]. `block` is the tests' handle."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if logits.shape[0]:
        logsumexp_kernel[(logits.shape[0],)](logits, out, logits.shape[1], logits.stride(0), BLOCK=block)
    return out


@torch.library.custom_op("autobucket_triton::logsumexp", mutates_args=())
def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> fp32 [rows]."""
    return launch_logsumexp(logits)


@logsumexp.register_fake
def _(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


def log_softmax_at(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab], tokens [rows] long -> fp32 [rows]: log_softmax(logits)[row, token]."""
    picked = logits.gather(-1, tokens[:, None])[:, 0].float()
    return picked - logsumexp(logits)
