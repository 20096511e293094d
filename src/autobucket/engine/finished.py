"""What a finished request is, on every route: its tokens through the first EOS, why it stopped, and
(when asked for) each token's log-probability."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Finished:
    tokens: list[int]
    reason: str  # "eos" | "length"
    logprobs: list[float] | None = None


def cut_at_eos(tokens: list[int], eos: frozenset[int], max_new_tokens: int) -> tuple[list[int], str]:
    """Tokens through the first EOS (inclusive) within the budget, and the finish reason."""
    for position, token in enumerate(tokens[:max_new_tokens]):
        if token in eos:
            return tokens[: position + 1], "eos"
    return tokens[:max_new_tokens], "length"
