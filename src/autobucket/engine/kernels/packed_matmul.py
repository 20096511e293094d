"""The GEMM of one packed linear: a packed copy (`Pack`) and the call that runs on it (`packed_matmul`).

fp32 GEMMs (fp32 weights, and bf16 weights where oneDNN's bf16 GEMM is not trusted or absent) run
the engine's own fixed-order kernel where its library builds with AVX-512 or AVX2
(`csrc/fixed_order_linear.cpp`: each output one FMA chain over k in order, so invariant by construction,
no probe and no M = 1 workaround), else oneDNN's fp32 GEMM, a single row run as two (oneDNN's M = 1 path
can differ). The fixed-order kernel is faster than oneDNN at a decode step's few rows and about level
at prefill sizes (`benchmarks/kernels/fp32_linears.py`, docs/kernels.md). A weight past the packed-weight budget is read where it
is by the kernel's unpacked form (`fixed_order_linear_unpacked`: the same chains, bitwise). A bf16
weight's panels stay bf16, widened in registers as the kernel reads them (exact), so they hold and
stream half the bytes of fp32 panels of the same values.

bf16 GEMMs run oneDNN's bf16 GEMM in the fixed row blocks `onednn_probes.py` found invariant for the
weight's shape."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from autobucket.engine.kernels.onednn_probes import (
    DECODE_BLOCKS,
    HEAD_BLOCKS,
    LARGE_BLOCK_MAX_OUT,
    LARGE_BLOCKS,
    ROW_BLOCK,
    SMALL_BLOCK,
    bf16_large_block_agrees,
    onednn_linear,
)

FIXED_ORDER_PANEL = 32  # output columns per panel of `fixed_order_linear` (csrc/fixed_order_linear.cpp)


@dataclass
class Pack:
    """A packed copy of one weight and how its GEMM runs (kept by `PackedLinears`, keyed on the weight)."""

    owner: weakref.ref  # the weight this copy was made from
    version: tuple[int, int | None, int] | None  # (data_ptr, _version, optimizer steps) when packed; None: stale
    packed: torch.Tensor  # oneDNN-blocked copy of the weight (bf16 when `row_blocks`), or fixed-order panels
    row_blocks: bool  # a bf16 GEMM run in ROW_BLOCK-row blocks (else one fp32 GEMM over all rows)
    small_block: bool = False  # calls of <= SMALL_BLOCK rows run as one SMALL_BLOCK-row block
    fixed_order: bool = False  # panels [ceil(N / 32), K, 32] (fp32, or bf16) for `fixed_order_linear` (else oneDNN)
    out_features: int = 0
    unpacked: bool = False  # fixed order on the weight itself, fp32 or bf16 [N, K] (a call past the budget)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


def packed_matmul(x: torch.Tensor, pack: Pack, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] on `pack` (+ bias [N]) -> [..., N], in x's dtype."""
    # [M, K]: oneDNN's 2-D path is faster than [M, 1, K]; contiguous, so a fused GEMM's column view as input
    # (a LoRA layer's lora_B reads lora_A's columns) gives the GEMM the layout the trainer's call has
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = _in_row_blocks(rows, pack, bias) if pack.row_blocks else _in_fp32(rows, pack, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _in_fp32(rows: torch.Tensor, pack: Pack, bias: torch.Tensor | None) -> torch.Tensor:
    """One fp32 GEMM over all rows, rounded to the input's dtype: [M, K] -> [M, N]."""
    widened = rows.dtype != torch.float32  # fp32 inputs skip the conversions, a fixed cost per call
    rows_fp32 = rows.float() if widened else rows
    bias_fp32 = None if bias is None else (bias.float() if bias.dtype != torch.float32 else bias)
    if pack.unpacked:
        out = torch.ops.autobucket.fixed_order_linear_unpacked(rows_fp32, pack.packed, bias_fp32)
    elif pack.fixed_order and rows.dtype == torch.bfloat16:  # rounded to bf16 as the kernel copies it out
        return torch.ops.autobucket.fixed_order_linear_bf16(rows_fp32, pack.packed, bias_fp32, pack.out_features)
    elif pack.fixed_order:
        out = torch.ops.autobucket.fixed_order_linear(rows_fp32, pack.packed, bias_fp32, pack.out_features)
    elif rows.shape[0] == 1:  # one row: oneDNN's M = 1 path can differ, run it as two
        out = onednn_linear(rows_fp32.expand(2, -1), pack.packed, bias_fp32)[:1]
    else:
        out = onednn_linear(rows_fp32, pack.packed, bias_fp32)
    return out.to(rows.dtype) if widened else out


def _in_row_blocks(rows: torch.Tensor, pack: Pack, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16 GEMMs of exactly one block's rows each, the last block zero-padded: [M, K] -> [M, N]. The
    block is ROW_BLOCK rows, or SMALL_BLOCK for a call that fits one where the shape allows it; a
    prefill-sized call runs its leading rows in `LARGE_BLOCKS` where the shape's probe allows them."""
    count = rows.shape[0]
    large = large_blocks_for(count, rows.shape[1], pack.packed.shape[0], bias is not None)
    if large:
        return _in_large_blocks(rows, pack, bias, large)
    return _in_fixed_blocks(rows, pack, bias)


def large_blocks_for(count: int, in_features: int, out_features: int, has_bias: bool) -> list[int]:
    """The large blocks a call of `count` rows starts with, largest first, each bitwise the rows'
    ROW_BLOCK-row results (probed per shape and size at the first call that could use it)."""
    ladder = LARGE_BLOCKS if out_features <= LARGE_BLOCK_MAX_OUT else HEAD_BLOCKS
    if count < ladder[-1]:
        return []
    sizes, left = [], count
    for size in ladder:
        while left >= size and bf16_large_block_agrees(in_features, out_features, size, has_bias):
            sizes.append(size)
            left -= size
    return sizes


def _in_large_blocks(rows: torch.Tensor, pack: Pack, bias: torch.Tensor | None, sizes: list[int]) -> torch.Tensor:
    pieces, first = [], 0
    for size in sizes:  # one oneDNN call each: a large block is one fixed shape too
        pieces.append(onednn_linear(rows[first : first + size], pack.packed, bias))
        first += size
    if first < rows.shape[0]:
        pieces.append(_in_fixed_blocks(rows[first:], pack, bias))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def decode_block_for(count: int, in_features: int, out_features: int, has_bias: bool) -> int | None:
    """The one padded call a call of `count` rows (33-128) runs as: the smallest `DECODE_BLOCKS` size
    that holds it and whose probe finds each row bitwise its `ROW_BLOCK`-row result; None: 32-row blocks."""
    if not ROW_BLOCK < count <= DECODE_BLOCKS[-1]:
        return None
    for size in DECODE_BLOCKS:
        if size >= count and bf16_large_block_agrees(in_features, out_features, size, has_bias):
            return size
    return None


def _in_fixed_blocks(rows: torch.Tensor, pack: Pack, bias: torch.Tensor | None) -> torch.Tensor:
    """The loop of one-block calls: in the engine's C++ library (`blocked_linear`) once it is built,
    else here (the same calls). A call of 33-128 rows is one padded call where `decode_block_for` finds one."""
    count = rows.shape[0]
    if pack.small_block and count <= SMALL_BLOCK:
        block = SMALL_BLOCK
    else:
        block = decode_block_for(count, rows.shape[1], pack.packed.shape[0], bias is not None) or ROW_BLOCK
    blocked_linear = _blocked_linear_op()
    if blocked_linear is not None:
        return blocked_linear(rows, pack.packed, bias, block)
    padding = -count % block
    if padding:
        rows = torch.cat([rows, rows.new_zeros(padding, rows.shape[1])])
    starts = range(0, len(rows), block)
    blocks = [onednn_linear(rows[first : first + block], pack.packed, bias) for first in starts]
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return out[:count] if padding else out



def panels_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The fixed-order panels of a [N, K] weight: [ceil(N / 32), K, 32]."""
    return -(-out_features // FIXED_ORDER_PANEL), in_features, FIXED_ORDER_PANEL


def panel_bytes(out_features: int, in_features: int, dtype: torch.dtype = torch.float32) -> int:
    panels, _, width = panels_shape(out_features, in_features)
    return panels * width * in_features * panels_dtype(dtype).itemsize


def panels_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The panels' dtype for a weight of `weight_dtype`: bf16 stays bf16 (the kernel widens it as it
    reads, exactly), anything else becomes fp32."""
    return torch.bfloat16 if weight_dtype == torch.bfloat16 else torch.float32


def fixed_order_panels(dense: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A [N, K] weight as `fixed_order_linear`'s panels [ceil(N / 32), K, 32] (bf16 for a bf16 weight,
    else fp32: `panels_dtype`), columns past N zero; written into `out` (an earlier pack of the same shape
    and dtype) where given. One strided copy: no padded or widened temporary, and into `out` no new pages (a
    repack through a padded copy into a new tensor writes a large head's bytes three times and faults in
    its pages)."""
    out_features, in_features = dense.shape
    shape = panels_shape(out_features, in_features)
    panels, full = shape[0], out_features // FIXED_ORDER_PANEL
    if out is None:
        out = torch.empty(shape, dtype=panels_dtype(dense.dtype))
    if full:  # [full * 32, K] -> [full, K, 32]
        out[:full].copy_(dense[: full * FIXED_ORDER_PANEL].view(full, FIXED_ORDER_PANEL, in_features).transpose(1, 2))
    if full < panels:  # the last panel's columns past N are zero
        tail = out[full]
        tail.zero_()
        tail[:, : out_features - full * FIXED_ORDER_PANEL].copy_(dense[full * FIXED_ORDER_PANEL :].t())
    return out


@functools.cache
def fixed_order_op():
    """The fixed-order fp32 linear where the kernel library builds with AVX-512 or AVX2, else None (oneDNN's fp32
    GEMM instead: see the module docstring)."""
    from autobucket.engine.kernels.library import kernel_library_builds

    if not kernel_library_builds():  # oneDNN serves
        return None
    return torch.ops.autobucket.fixed_order_linear if torch.ops.autobucket.fixed_order_linear_vectorized() else None


@functools.cache
def _blocked_linear_op():
    """The C++ block loop, or None where the engine's kernel library does not build (no compiler)."""
    from autobucket.engine.kernels.library import kernel_library_builds

    if not kernel_library_builds():  # the Python loop gives the same calls
        return None
    return torch.ops.autobucket.blocked_linear
