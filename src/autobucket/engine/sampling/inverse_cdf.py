"""Inverse-CDF sampling of one token per row from warped scores, and the kernel library's vector ops
the selection takes where they build (`vector_op`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

SAMPLE_BLOCK = 128  # vocabulary entries per block of `sample_inverse_cdf`'s first pass (divides 32,000,
# 49,152 and 151,936; any other vocabulary gets a shorter last block)


def sample_inverse_cdf(scores: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [rows] and their log-probabilities [rows] under softmax(scores).

    scores: [rows, vocab] warped logits; uniforms: [rows] in [0, 1). The token is the first whose
    cumulative probability (softmax in fp32) exceeds the draw u x total; filtered tokens (-inf) weigh 0
    and are never chosen, and the draw is kept strictly below the total. A row holding NaN or +inf, or
    with every token filtered, defines no distribution: RuntimeError naming it.

    Why in blocks: torch's `cumsum` over a row is one sequential loop, not vectorized. So the cumulative probability runs over `SAMPLE_BLOCK`-entry block sums
    (vectorized), and only the block the draw lands in is scanned entry by entry. CPUs with AVX2 or
    AVX-512 run that as one op (`csrc/sample_inverse_cdf.cpp`: two sweeps over a row, nothing written
    but the answer; `benchmarks/kernels/sampler.py` has its times), elsewhere `blockwise_inverse_cdf` in torch
    ops (faster than the full-row form). Every value is a function of the row alone (the same on
    every route and batch); rounding moves token boundaries by ~1e-7 of probability mass against the
    exact CDF, differently in the two forms.
    """
    kernel = _sampler_kernel()
    if kernel is None or scores.device.type != "cpu":
        return blockwise_inverse_cdf(scores, uniforms)
    tokens, logprobs = kernel(scores.float(), uniforms.double())
    declined = tokens < 0  # [rows]: the kernel's answer for a row holding NaN or +inf, or all -inf
    if bool(declined.any()):
        raise _unsamplable(declined)
    return tokens, logprobs


class UnsamplableRows(RuntimeError):
    """A step's rows whose scores define no distribution (NaN or +inf, or every token filtered to -inf), as
    torch.multinomial refuses them. `rows` are the step's row indices; `where` names them for the caller
    (`select_tokens`: by prompt, sample and token), else they are named as rows."""

    def __init__(self, rows: list[int], where: list[str] | None = None) -> None:
        self.rows = rows
        named = where if where is not None else [f"rows {rows[:8]}{' ...' if len(rows) > 8 else ''}"]
        shown = ", ".join(named[:8]) + (" ..." if where is not None and len(named) > 8 else "")
        super().__init__(
            f"cannot sample {shown} of this step: their logits hold NaN or +inf, or every token was filtered "
            "to -inf. The model's forward produced them: check its weights and inputs (an fp16 overflow, a "
            "diverged update)"
        )


def _unsamplable(rows: torch.Tensor) -> UnsamplableRows:
    """The error for rows [rows] bool whose scores define no distribution."""
    return UnsamplableRows(rows.nonzero().flatten().tolist())


def _sampler_kernel() -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """The kernel library's one-sweep sampler (`csrc/sample_inverse_cdf.cpp`), built where the CPU has
    AVX2 or AVX-512; elsewhere `blockwise_inverse_cdf`."""
    return vector_op("sample_inverse_cdf")


@functools.cache
def vector_op(name: str) -> Callable | None:
    """`torch.ops.autobucket.<name>` where the kernel library builds with a vector form (AVX-512 or AVX2),
    else None: the selection ops' scalar loops are slower than their torch-op fallbacks (a scalar loop
    over the vocabulary against vectorized torch ops), and the sampler registers only its vector form."""
    from autobucket.engine.kernels.library import kernel_library_builds

    if not kernel_library_builds() or torch.ops.autobucket.vector_bits() < 256:
        return None
    return getattr(torch.ops.autobucket, name)


def blockwise_inverse_cdf(scores: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_inverse_cdf` in torch ops, where the kernel is not built."""
    vocab = scores.shape[1]
    weights = torch.softmax(scores.float(), dim=-1)  # [rows, vocab]: one fused pass, faster than exp then a sum
    block_sums = _block_sums(weights)  # [rows, blocks]
    cumulative = block_sums.cumsum(dim=-1)
    total = cumulative[:, -1:]  # [rows, 1]
    defined = torch.isfinite(total) & (total > 0)  # softmax of a row with NaN / +inf / only -inf is NaN
    if not bool(defined.all()):
        raise _unsamplable(~defined.squeeze(-1))
    draws = torch.minimum(uniforms.to(total)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # the first block whose cumulative weight exceeds the draw (always one: draw < total)
    block = torch.searchsorted(cumulative, draws, right=True).clamp_(max=cumulative.shape[1] - 1)  # [rows, 1]
    before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp_(min=0)), torch.zeros_like(draws))
    columns = block * SAMPLE_BLOCK + torch.arange(SAMPLE_BLOCK, device=scores.device)  # [rows, SAMPLE_BLOCK]
    inside = weights.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(columns >= vocab, 0.0)
    running = before + inside.cumsum(dim=-1)  # non-decreasing: the CDF inside the block
    offset = torch.searchsorted(running, draws, right=True)  # [rows, 1]
    # Rounding can leave the block's last running value at or below a draw its block sum passed: then
    # the block's last token of non-zero weight is the one (no filtered token is ever chosen).
    last_kept = SAMPLE_BLOCK - 1 - (inside > 0).flip(-1).byte().argmax(dim=-1, keepdim=True)
    offset = torch.where(offset >= SAMPLE_BLOCK, last_kept, offset)
    tokens = (block * SAMPLE_BLOCK + offset).squeeze(-1)
    logprobs = (weights.gather(1, tokens[:, None]) / total).log().squeeze(-1)
    return tokens, logprobs


def _block_sums(weights: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows, ceil(vocab / SAMPLE_BLOCK)]: each block's sum, the last block shorter."""
    rows, vocab = weights.shape
    whole = vocab // SAMPLE_BLOCK * SAMPLE_BLOCK
    sums = weights[:, :whole].reshape(rows, -1, SAMPLE_BLOCK).sum(dim=-1)
    if whole < vocab:
        sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    return sums

