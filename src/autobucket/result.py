"""`RolloutResult`: generated tokens per prompt in input order, plus the profile."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from autobucket.profile import Profile


@dataclass
class RolloutResult:
    """Per prompt, in input order. With `SamplingConfig(n=k)`, k > 1, each prompt's entry of `tokens`,
    `finish_reasons` and `logprobs` is a list of k samples (`tokens[prompt][sample]` is a token list)."""

    tokens: list  # generated ids per prompt (or per prompt per sample), through the first EOS inclusive
    finish_reasons: list  # "eos" | "stop" (a stop string) | "length", same nesting as tokens
    route: str  # the route that ran ("ordinary", "equal_width", "aligned"; auto: "ordinary" | "bucketed")
    profile: Profile = field(default_factory=Profile)
    logprobs: list | None = None  # log-probability of each generated token (SamplingConfig(logprobs=True))

    def flat_tokens(self) -> list[list[int]]:
        """One token list per (prompt, sample) row, prompt-major."""
        if self.tokens and self.tokens[0] and isinstance(self.tokens[0][0], list):
            return [sample for samples in self.tokens for sample in samples]
        return list(self.tokens)

    def to_padded(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded responses `[rows, longest]` and their mask (1 = generated token); rows are
        prompts, or (prompt, sample) pairs prompt-major when n > 1."""
        if isinstance(pad_id, bool) or not isinstance(pad_id, numbers.Integral):
            hint = " (this tokenizer has no pad token: pass its eos_token_id, or 0; the mask marks padding)"
            raise ValueError(f"pad_id={pad_id!r} is invalid: pass an int token id{hint if pad_id is None else ''}")
        rows = self.flat_tokens()
        width = max((len(t) for t in rows), default=0)
        responses = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, tokens in enumerate(rows):
            responses[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
            mask[row, : len(tokens)] = 1
        return responses, mask
