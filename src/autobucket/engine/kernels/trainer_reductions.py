"""The reductions an RL trainer runs to score a token, over a decode step's logits, as kernel ops that give
torch's bits in one pass per row (`csrc/trainer_logprobs.cpp`).

Trainer-mode logprobs (`engine/trainer_logprobs.py`) are computed the way TRL's `selective_log_softmax`
does, because their bits must be the trainer's: fp32 as `logit - logsumexp(logits)`, bf16 as
`log_softmax(logits)` at the token. torch's ops write a [rows, vocab] temporary (or output) and read it
back, a cost that grows with the vocabulary and, for a decode step's logits just pushed out of cache by
the head's weight, is paid from memory. The kernels do the same operations on one row at a
time in cache and write only the answer: the fp32 one with MKL's vmsExp, which ATen's exp calls, and
ATen's sum order (`csrc/aten_sum.h`); the bf16 one with ATen's AVX2 log_softmax arithmetic (Sleef's exp
and log, its two-accumulator sum and lane tree, its bf16 roundings).

Where a kernel takes a call: CPU logits [rows, vocab], contiguous, no gradient wanted; fp32 with vocab >= 8
and not a single row long enough (>= ATen's grain of 32,768) for ATen to split its sum over threads; bf16
with vocab >= 16 where ATen runs its AVX2 kernels and the library was built for AVX2. Before its first use
each kernel is compared with torch's op on a probe; a build where they differ keeps torch's op (and says
so once), so a torch release that computes another way cannot change what a caller gets."""

from __future__ import annotations

import functools
import math
import warnings

import torch

from autobucket.engine.kernels.library import kernel_library_builds

ATEN_GRAIN_SIZE = 32_768  # at::internal::GRAIN_SIZE: past it, ATen sums a lone output over its threads


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits [rows, vocab] -> [rows, 1]: `torch.logsumexp(logits, dim=-1, keepdim=True)`, bitwise."""
    if _takes_fp32(logits):
        return torch.ops.autobucket.trainer_logsumexp(logits)
    return torch.logsumexp(logits, dim=-1, keepdim=True)


def log_softmax_at(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab], tokens [rows] long -> [rows] in logits' dtype: `torch.log_softmax(logits,
    dim=-1)` at each row's token, bitwise."""
    if _takes_bf16(logits, tokens):
        return torch.ops.autobucket.trainer_log_softmax_at(logits, tokens)
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def log_softmax_at_widened(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits [rows, vocab] whose every value is a bf16 (a bf16 model's logits widened), tokens [rows]
    long -> bf16 [rows]: bitwise `log_softmax_at(logits.to(torch.bfloat16), tokens)`, without the copy."""
    if _takes_bf16(logits, tokens, dtype=torch.float32):
        return torch.ops.autobucket.trainer_log_softmax_at_widened(logits, tokens)
    return log_softmax_at(logits.to(torch.bfloat16), tokens)


def _plain_rows(logits: torch.Tensor) -> bool:
    return (
        logits.dim() == 2 and logits.shape[0] > 0 and logits.device.type == "cpu" and logits.is_contiguous()
        and not (logits.requires_grad and torch.is_grad_enabled())
    )


def _takes_fp32(logits: torch.Tensor) -> bool:
    if logits.dtype != torch.float32 or not _plain_rows(logits) or logits.shape[1] < 8:
        return False
    threads_split_its_sum = logits.shape[0] == 1 and logits.shape[1] >= ATEN_GRAIN_SIZE and torch.get_num_threads() > 1
    return not threads_split_its_sum and fp32_available()


def _takes_bf16(logits: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> bool:
    return (
        logits.dtype == dtype and _plain_rows(logits) and logits.shape[1] >= 16
        and tokens.dtype == torch.long and tokens.shape == logits.shape[:1] and tokens.device.type == "cpu"
        and bf16_available()
    )


@functools.cache
def fp32_available() -> bool:
    """The kernel library builds, torch has MKL's vector math, and the kernel agrees with torch's logsumexp."""
    if not kernel_library_builds() or not torch.ops.autobucket.trainer_logsumexp_available():
        return False
    return _agreed("trainer_logsumexp", "torch.logsumexp", _logsumexp_agrees)


@functools.cache
def bf16_available() -> bool:
    """The library is an AVX2 build, ATen runs its AVX2 kernels, and the kernel agrees with torch's log_softmax."""
    if not kernel_library_builds() or not torch.ops.autobucket.trainer_log_softmax_at_available():
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX2" or torch.ops.autobucket.vector_bits() != 256:
        return False
    return _agreed("trainer_log_softmax_at", "torch.log_softmax", _log_softmax_agrees)


def _agreed(kernel: str, op: str, agrees) -> bool:
    if agrees():
        return True
    warnings.warn(
        f"autobucket's {kernel} kernel differs from {op} on this torch build; trainer-mode logprobs use "
        "torch's op (the same values, a few ms more a decode step)",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


def _probe_logits(rows: int, vocab: int) -> torch.Tensor:
    """Rows whose sum order and exp show in the last bits: a language model's spread, and near-flat rows;
    one with some and one with only -inf."""
    generator = torch.Generator().manual_seed(0)
    probe = 3 * torch.randn(rows, vocab, generator=generator, dtype=torch.float32)
    probe[1::2] = -0.7 * torch.rand(probe[1::2].shape, generator=generator, dtype=torch.float32)
    probe[1, :100] = -math.inf
    probe[2] = -math.inf
    return probe


def _logsumexp_agrees() -> bool:
    """A vector tail (4,099 columns) and ATen's cascade levels (over 64 vectors)."""
    probe = _probe_logits(6, 4_099)
    with torch.inference_mode():
        return torch.equal(torch.ops.autobucket.trainer_logsumexp(probe), torch.logsumexp(probe, -1, keepdim=True))


def _log_softmax_agrees() -> bool:
    """Both partial-vector tails (4,099 and 4,105 columns), every token of the probe's rows."""
    for vocab in (4_099, 4_105):
        probe = _probe_logits(6, vocab).bfloat16()
        probe[2] = 0.0  # a row of only -inf is NaN in both: compared on finite rows
        with torch.inference_mode():
            want = torch.log_softmax(probe, dim=-1)
            for token in range(0, vocab, 97):
                tokens = torch.full((6,), token, dtype=torch.long)
                if not torch.equal(torch.ops.autobucket.trainer_log_softmax_at(probe, tokens), want[:, token]):
                    return False
    return True
