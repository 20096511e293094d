"""The trainer's fp32 `logsumexp` over a decode step's logits, in one pass per row, bitwise torch's op.

Trainer-mode logprobs (`engine/trainer_logprobs.py`) are `logit - logsumexp(logits)` because that is
what TRL's `selective_log_softmax` computes for fp32, and the bits must be the trainer's. torch's op
writes `(x - max).exp_()` as a [rows, vocab] temporary and sums it back: 4 ms a step for 64 rows over a
32,000 vocabulary, 1.16x a GRPO-like call. `csrc/trainer_logsumexp.cpp` does the same operations on one
row at a time in a buffer that stays in cache: the same max, the same subtraction, the same exp (MKL's
vmsExp, which ATen's exp calls), ATen's sum order (`csrc/aten_sum.h`), the same log.

Where the kernel takes a call: fp32 CPU logits [rows, vocab >= 8], contiguous, and not a single row long
enough (>= ATen's grain of 32,768) for ATen to split its sum over threads. Before the first use, the
kernel is compared with torch's op on a probe; a build where they differ keeps torch's op (and says so
once), so a torch release that computes its exp another way cannot change what a caller gets."""

from __future__ import annotations

import functools
import math
import warnings

import torch

from autobucket.engine.kernels.invariant_attention import kernel_library_builds

ATEN_GRAIN_SIZE = 32_768  # at::internal::GRAIN_SIZE: past it, ATen sums a lone output over its threads


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> [rows, 1]: `torch.logsumexp(logits, dim=-1, keepdim=True)`, bitwise."""
    if _takes(logits):
        return torch.ops.autobucket.trainer_logsumexp(logits)
    return torch.logsumexp(logits, dim=-1, keepdim=True)


def _takes(logits: torch.Tensor) -> bool:
    rows, vocab = logits.shape if logits.dim() == 2 else (0, 0)
    threads_split_its_sum = rows == 1 and vocab >= ATEN_GRAIN_SIZE and torch.get_num_threads() > 1
    return (
        logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.is_contiguous()
        and rows > 0 and vocab >= 8 and not threads_split_its_sum
        and not (logits.requires_grad and torch.is_grad_enabled()) and available()
    )  # fmt: skip


@functools.cache
def available() -> bool:
    """The kernel library builds, torch has MKL's vector math, and the kernel agrees with torch's op."""
    if not kernel_library_builds() or not torch.ops.autobucket.trainer_logsumexp_available():
        return False
    if not _agrees_with_torch():
        warnings.warn(
            "autobucket's trainer_logsumexp kernel differs from torch.logsumexp on this torch build; "
            "trainer-mode logprobs use torch's op (the same values, ~4 ms more a decode step)",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def _agrees_with_torch() -> bool:
    """Bitwise equal on a probe: a vector tail (4,099 columns), ATen's cascade levels (over 64 vectors), a
    row with some and a row with only -inf, magnitudes whose sum order shows in the last bits."""
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(4, 4_099, generator=generator) * torch.exp(2 * torch.randn(4, 4_099, generator=generator))
    probe[1, :100] = -math.inf
    probe[2] = -math.inf
    with torch.inference_mode():
        return torch.equal(torch.ops.autobucket.trainer_logsumexp(probe), torch.logsumexp(probe, -1, keepdim=True))
