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


def select_greedy(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """[rows, vocab] fp32 -> [rows] token ids (argmax after the optional penalty)."""
    if seen is not None and penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, penalty)
    return logits.argmax(dim=-1)


class PaddingAwareRepetitionPenalty:
    """HF logits processor for the ordinary route: the penalty over each row's real tokens only.

    HF's own processor would also penalise the pad id in left-padded rows, which makes a row's tokens
    depend on its batch; `pad_lengths[b]` leading positions of row b are ignored here.
    """

    def __init__(self, penalty: float, pad_lengths: Sequence[int]) -> None:
        self.penalty = penalty
        self.pad_lengths = torch.as_tensor(list(pad_lengths), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        real = positions[None, :] >= self.pad_lengths.to(input_ids.device)[:, None]
        rows, columns = torch.nonzero(real, as_tuple=True)
        seen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        seen[rows, input_ids[rows, columns]] = True
        return apply_repetition_penalty(scores.float(), seen, self.penalty).to(scores.dtype)
