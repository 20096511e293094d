"""The log-probability an RL trainer computes for a token, computed the trainer's way.

TRL's `selective_log_softmax` (its CPU / non-Triton path) on the logits in the model's dtype, divided by
the temperature first: fp32 as `logit - logsumexp(logits)`, bf16 / fp16 as `log_softmax(logits)` in
that dtype. Both are per-row reductions, so a row's value depends on its logits alone; with the
invariant kernels the rollout's logits equal the trainer's bitwise, and so do these logprobs."""

from __future__ import annotations

import torch


def trainer_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [..., vocab] (the model's dtype), tokens [...] long -> logprobs [...] in logits' dtype."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature!r} is invalid: pass a positive temperature (1.0 when greedy)")
    if temperature != 1.0:
        logits = logits / temperature
    index = tokens.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        return (logits.gather(-1, index) - torch.logsumexp(logits, dim=-1, keepdim=True)).squeeze(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, index).squeeze(-1)
