"""`RolloutResult`: generated tokens per prompt in input order, plus the profile."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autobucket.profile import Profile


@dataclass
class RolloutResult:
    tokens: list[list[int]]  # generated ids per prompt, through the first EOS inclusive
    finish_reasons: list[str]  # "eos" | "length" per prompt
    route: str  # the route that ran ("ordinary", "equal_width", "aligned"; auto: "ordinary" | "bucketed")
    profile: Profile = field(default_factory=Profile)

    def to_padded(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded responses `[prompts, longest]` and their mask (1 = generated token)."""
        width = max((len(t) for t in self.tokens), default=0)
        responses = torch.full((len(self.tokens), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(self.tokens), width), dtype=torch.long)
        for row, tokens in enumerate(self.tokens):
            responses[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
            mask[row, : len(tokens)] = 1
        return responses, mask
