"""What a finished request is, on every route: its tokens through the first EOS or completed stop string,
why it stopped, and (when asked for) each token's log-probability."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# An id past any tokenizer's table: HF's stop-string matcher clamps such ids to an entry that matches no
# string, so a window padded with it on the left matches exactly as the shorter sequence would.
_MATCHES_NOTHING = 2**62


@dataclass
class Finished:
    tokens: list[int]
    reason: str  # "eos" | "stop" | "length"
    logprobs: list[float] | None = None


class StopStrings:
    """Which requests their newest token ends by completing a stop string.

    The matching is transformers' own `StopStringCriteria` (what `generate(stop_strings=..., tokenizer=...)`
    runs), applied to each request's own ids (its prompt, then what it generated), never to another
    row's padding: so every route, batch and refill order stops a request at the same token."""

    def __init__(self, tokenizer: Any, strings: Sequence[str]) -> None:
        from transformers import StopStringCriteria

        self.strings = tuple(strings)
        self.criteria = StopStringCriteria(tokenizer, list(self.strings))
        self.window = self.criteria.maximum_token_len  # a token holds at least one character

    def completed(self, sequences: Sequence[Sequence[int]]) -> list[bool]:
        """Per sequence (prompt ids then generated ids, or any tail of them at least `window` long):
        whether its last token completes one of the strings."""
        if not sequences:
            return []
        window = self.window
        rows = [[_MATCHES_NOTHING] * (window - len(tail)) + list(tail) for tail in (s[-window:] for s in sequences)]
        return self.criteria(torch.tensor(rows, dtype=torch.long), None).tolist()

    def tail(self, prompt: Sequence[int], generated: Sequence[int]) -> list[int]:
        """The last `window` ids of prompt + generated: all that `completed` reads of a request."""
        if len(generated) >= self.window:
            return list(generated[-self.window :])
        return [*prompt[-(self.window - len(generated)) :], *generated]


def cut_finished(
    tokens: list[int], eos: frozenset[int], max_new_tokens: int, stop_length: int | None = None
) -> tuple[list[int], str]:
    """Tokens through the first EOS (inclusive) or, before it, the token that completed a stop string
    (`stop_length`: how many tokens that made), within the budget; and the finish reason."""
    limit = max_new_tokens if stop_length is None else min(stop_length, max_new_tokens)
    for position, token in enumerate(tokens[:limit]):
        if token in eos:
            return tokens[: position + 1], "eos"
    if stop_length is not None and stop_length <= max_new_tokens:
        return tokens[:stop_length], "stop"
    return tokens[:max_new_tokens], "length"
