"""Next-token selection: small pure functions over fp32 logits `[rows, vocab]`.

The repetition penalty follows HF's `RepetitionPenaltyLogitsProcessor` exactly (negative logits
multiplied, positive divided, computed in fp32), but over a `seen` mask `[rows, vocab]` of the
prompt's and generated tokens, never of padding: a row's history does not depend on who it was
batched with."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [rows, vocab] fp32, seen [rows, vocab] bool -> penalised logits [rows, vocab]."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def seen_tokens(prompts: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] bool: which token ids occur in each prompt."""
    seen = torch.zeros((len(prompts), vocab_size), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        seen[row, torch.as_tensor(prompt, dtype=torch.long)] = True
    return seen.to(device)
