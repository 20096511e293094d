"""The first argmax of each row, as `torch.argmax` answers it, without its slow index-tracking reduction."""

from __future__ import annotations

from collections.abc import Callable

import torch

from autobucket.engine.sampling.inverse_cdf import vector_op

ARGMAX_BLOCK = 1024  # vocabulary entries per block of `first_argmax`'s first pass


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows] int64: `argmax`'s answer (the first maximal value on ties; the first NaN
    in a row that has one). torch's index-tracking reductions (`argmax`, `max(-1).indices`) do not
    vectorize on a CPU, while `amax` does. fp32 CPU logits take the kernel library's one-sweep op
    (`csrc/first_argmax.cpp`), where it builds with AVX-512 or AVX2."""
    kernel = _argmax_kernel()
    if kernel is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[-1] > 0:
        return kernel(logits)
    return two_pass_argmax(logits)


def _argmax_kernel() -> Callable[[torch.Tensor], torch.Tensor] | None:
    return vector_op("first_argmax")


def two_pass_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`first_argmax` in torch ops, where the kernel library does not build (vectorized `amax` first):
    pass one, each block's maximum (`amax`); pass two, `max` over the first block that holds the row's
    maximum only. A row with NaN keeps `max`'s answer (the first NaN, as `argmax` gives)."""
    rows, vocab = logits.shape
    if vocab < 4 * ARGMAX_BLOCK or logits.device.type != "cpu":
        return logits.max(dim=-1).indices
    whole = vocab // ARGMAX_BLOCK * ARGMAX_BLOCK
    block_max = logits[:, :whole].reshape(rows, -1, ARGMAX_BLOCK).amax(-1)  # [rows, blocks]
    if whole < vocab:
        block_max = torch.cat([block_max, logits[:, whole:].amax(-1, keepdim=True)], dim=1)
    row_max = block_max.amax(-1, keepdim=True)  # [rows, 1]
    if bool(row_max.isnan().any()):
        return logits.max(dim=-1).indices
    first_block = (block_max == row_max).byte().argmax(-1)  # [rows]: argmax takes the first on ties
    start = first_block * ARGMAX_BLOCK
    columns = (start[:, None] + torch.arange(ARGMAX_BLOCK, device=logits.device)).clamp_(max=vocab - 1)
    return start + logits.gather(1, columns).max(dim=-1).indices  # clamped repeats come after the real ones

