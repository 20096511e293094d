"""Tile sizes and the interpreter switch shared by the Triton kernels.

A row's GEMM result depends on BLOCK_K (the K steps its accumulator takes) and on nothing else that varies
with the batch, so the tiles are fixed per dtype and never chosen by the row count (the batch-invariant
recipe: bf16 128 x 128 x 64, fp32 128 x 128 x 32). Under Triton's interpreter (`TRITON_INTERPRET=1`, CPU
tensors) `tl.dot` runs through numpy, whose BLAS rounds a row by its place in the tile, so there the GEMM
accumulates each K step as an in-order product sum instead (`in_order_dot`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LinearTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


LINEAR_TILES = {
    torch.float32: LinearTiles(128, 128, 32, 8),
    torch.bfloat16: LinearTiles(128, 128, 64, 8),
    torch.float16: LinearTiles(128, 128, 64, 8),
}
ATTENTION_BLOCK_N = 32  # keys per block of the attention walk, counted from each query's first key
# queries per attention program: one size for every call, decode too, so the compiler lays every call's
# reductions out alike
ATTENTION_BLOCK_Q = 16
ROW_BLOCK = 1024  # columns per step of the row reductions' loops (RMSNorm takes a row in one block)


def interpreting() -> bool:
    """Whether the kernels run under Triton's interpreter (set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def linear_tiles(dtype: torch.dtype) -> LinearTiles:
    if dtype not in LINEAR_TILES:
        raise TypeError(f"the Triton linear takes float32, bfloat16 or float16 inputs, got {dtype}")
    return LINEAR_TILES[dtype]
