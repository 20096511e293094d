"""Where a request finishes, on every route: at its first EOS, at the token that completes a stop string
(`StopStrings`), or at its budget (`cut_finished` for a whole generated sequence)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# An id past any tokenizer's table: HF's stop-string matcher clamps such ids to an entry that matches no
# string, so a window padded with it on the left matches exactly as the shorter sequence would.
_MATCHES_NOTHING = 2**62


class StopStrings:
    """Which requests their newest token ends by completing a stop string.

    The matching is transformers' own `StopStringCriteria` (what `generate(stop_strings=..., tokenizer=...)`
    runs), applied to each request's own ids (its prompt, then what it generated), never to another
    row's padding: so every route, batch and refill order stops a request at the same token."""

    def __init__(self, tokenizer: Any, strings: Sequence[str]) -> None:
        from transformers import StopStringCriteria

        self.strings = tuple(strings)
        try:
            self.criteria = StopStringCriteria(tokenizer, list(self.strings))
        except ValueError as exc:  # transformers' own words are terse ("substring not found")
            raise ValueError(
                f"stop_strings={list(self.strings)!r} cannot be matched with this {type(tokenizer).__name__} "
                f"(transformers' StopStringCriteria: {exc}): use the model's own text tokenizer, or end requests "
                "with token ids (eos_token_id)"
            ) from exc
        self.window = self.criteria.maximum_token_len  # a token holds at least one character
        self.enders = _tokens_that_can_end_a_string(self.criteria)

    def completed(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[bool]:
        """Per request, (its prompt ids, its generated ids): whether its newest token completes one of the
        strings. Only requests whose newest token can end a string are read and matched (one batched call);
        on most steps that is none or few of the rows."""
        done = [False] * len(requests)
        candidates = [i for i, (_, generated) in enumerate(requests) if self.enders is None or generated[-1] in self.enders]
        if not candidates:
            return done
        tails = (self._tail(*requests[i]) for i in candidates)
        rows = [[_MATCHES_NOTHING] * (self.window - len(tail)) + tail for tail in tails]
        for i, matched in zip(candidates, self.criteria(torch.tensor(rows, dtype=torch.long), None).tolist(), strict=True):
            done[i] = matched
        return done

    def _tail(self, prompt: Sequence[int], generated: Sequence[int]) -> list[int]:
        """The last `window` ids (or fewer, all there are) of prompt + generated: all a match reads."""
        if len(generated) >= self.window:
            return list(generated[-self.window :])
        return [*prompt[-(self.window - len(generated)) :], *generated]


def _tokens_that_can_end_a_string(criteria: Any) -> frozenset[int] | None:
    """The ids whose text can hold a stop string's last character (HF's table of each token's "end
    overlaps"): a sequence whose last token is not one of them completes no string. None (match every
    sequence) where this transformers lays the table out otherwise than 4.57-5.x do."""
    table = getattr(criteria, "embedding_vec", None)
    positions, strings = getattr(criteria, "max_valid_positions", None), getattr(criteria, "num_stop_strings", None)
    if not isinstance(table, torch.Tensor) or not isinstance(positions, int) or not isinstance(strings, int):
        return None
    # columns: each string's valid positions, then each string's end-overlap lengths, then the token's length;
    # the last row is the entry for ids past the table, which matches nothing
    end_lengths = table[:-1, positions * strings : -1]
    return frozenset(torch.nonzero((end_lengths > 0).any(dim=1)).flatten().tolist())


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
