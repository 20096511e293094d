"""The log-probability an RL trainer computes for a token, computed the trainer's way.

TRL's `selective_log_softmax` (its CPU / non-Triton path) on the logits in the model's dtype, divided by
the temperature first: fp32 as `logit - logsumexp(logits)`, bf16 / fp16 as `log_softmax(logits)` in
that dtype. Both are per-row reductions, so a row's value depends on its logits alone; with the
invariant kernels the rollout's logits equal the trainer's bitwise, and so do these logprobs.
Also here: the trainer's batch layout (`teacher_forced_batch`) and how far two sets of logprobs are
apart (`mismatch_metrics`), shared by the TRL adapter, the tests and `benchmarks/mismatch.py`."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def trainer_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *, kernel: bool = False
) -> torch.Tensor:
    """logits [..., vocab] (the model's dtype), tokens [...] long -> logprobs [...] in logits' dtype.

    kernel=True (the engine's decode steps): logits [rows, vocab] take the fp32 logsumexp or the bf16
    log_softmax through the kernel library where it takes the call (`engine/kernels/trainer_reductions.py`),
    bitwise torch's ops in one pass per row. The default is torch's ops alone, as the trainer runs them,
    after checking the tokens against the logits (the engine's own calls skip that: their tokens come
    from these logits, and the kernels refuse an id outside the vocabulary themselves)."""
    if not temperature > 0 or temperature == float("inf"):  # NaN fails the first test
        raise ValueError(f"temperature={temperature!r} is invalid: pass a positive temperature (1.0 when greedy)")
    if not kernel:
        _check_tokens(logits, tokens)
    if temperature != 1.0:
        logits = logits / temperature
    if kernel and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16):
        from autobucket.engine.kernels import trainer_reductions  # torch-only callers never build the library

        if logits.dtype == torch.bfloat16:
            return trainer_reductions.log_softmax_at(logits, tokens)
        return (logits.gather(-1, tokens.unsqueeze(-1)) - trainer_reductions.logsumexp(logits)).squeeze(-1)
    index = tokens.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        return (logits.gather(-1, index) - torch.logsumexp(logits, dim=-1, keepdim=True)).squeeze(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, index).squeeze(-1)


def _check_tokens(logits: torch.Tensor, tokens: torch.Tensor) -> None:
    """One integer id in [0, vocab) per position of `logits` [..., vocab], else a ValueError saying which."""
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must hold integer ids (torch.long), got dtype {tokens.dtype}")
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(
            f"tokens {tuple(tokens.shape)} must have the logits' shape {tuple(logits.shape)} without its last "
            f"(vocabulary) dimension, {tuple(logits.shape[:-1])}: one token per scored position"
        )
    if tokens.numel() == 0:
        return
    vocab = logits.shape[-1]
    lowest, highest = (int(value) for value in torch.aminmax(tokens))  # one reduction, one sync
    if lowest < 0 or highest >= vocab:
        bad = lowest if lowest < 0 else highest
        raise ValueError(f"tokens hold id {bad}, outside the logits' vocabulary [0, {vocab})")


def teacher_forced_batch(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_token_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The layout an RL trainer scores: left-padded prompts + right-padded completions -> ids and mask
    `[rows, P + C]` and the prompt width P (completion token j of a row sits at column P + j). Position
    ids as generation counts them are `positions_from_mask(mask)` (`engine/batching/prefill.py`)."""
    prompt_width, completion_width = max(map(len, prompts)), max(map(len, completions))
    ids = torch.full((len(prompts), prompt_width + completion_width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        start, end = prompt_width - len(prompt), prompt_width + len(completion)
        ids[row, start:end] = torch.tensor([*prompt, *completion], dtype=torch.long)
        mask[row, start:end] = 1
    return ids, mask, prompt_width


def mismatch_metrics(trainer_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Sampler-trainer mismatch over the tokens where `mask` is set: k3 (mean of r - 1 - log r, r =
    p_trainer / p_sampler; in float64, as r - 1 - log r cancels to 0 in fp32 for differences ~1e-5) and
    the largest |logp difference|."""
    valid = mask.bool()
    if not bool(valid.any()):
        return {"mismatch/k3": 0.0, "mismatch/max_abs_logp_diff": 0.0}
    log_ratio = (trainer_logps.double() - sampling_logps.double())[valid]
    k3 = (torch.exp(log_ratio) - 1 - log_ratio).mean()
    return {"mismatch/k3": float(k3), "mismatch/max_abs_logp_diff": float(log_ratio.abs().max())}
