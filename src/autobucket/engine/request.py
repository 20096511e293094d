"""`Request`: the host record of one (prompt, sample) of a call, from the queue to its result.

Every route writes the same record: the continuous batcher from admission through decode steps to its
finish, the ordinary route from HF `generate`'s output. While a request decodes, its `cache_row` is its
index in the batcher's list of active records and its row of the runner's device arrays (`DecodeRows`:
the token it feeds next, that token's position, its seen ids), which mirror the records and are written
only where the batcher admits, advances or retires records."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from autobucket.engine.batching.prefill import PrefillOutput


@dataclass(frozen=True)
class PrefillRow:
    """Where a prompt's prefill lives: row `row` of `output` (its K/V and last logits)."""

    output: PrefillOutput
    row: int
    seen: torch.Tensor | None  # [vocab] bool: the prompt's ids (with a repetition penalty only)


@dataclass(eq=False)
class Request:
    """One (prompt, sample) of a call."""

    prompt: int  # its prompt's index in the call
    sample: int  # its index among that prompt's samples
    prompt_ids: Sequence[int]  # the prompt's tokens (the call's own list, not a copy)
    budget: int  # new tokens at most
    tokens: list[int] = field(default_factory=list)  # generated so far
    logprobs: list[float] | None = None  # one per token, when the call asks for them
    finish_reason: str | None = None  # "eos" | "stop" | "length" once finished
    prefill: PrefillRow | None = None  # its prompt's prefill, from prefill until its cache row holds the K/V
    cache_row: int | None = None  # its row of the KV cache and of the device arrays while it decodes
    shared_prefix: int | None = None  # the cache's group whose K/V it reads before its own columns, if any

    @property
    def key(self) -> tuple[int, int]:
        return self.prompt, self.sample

    @property
    def position(self) -> int:
        """The position of the token it feeds at its next decode step (its newest)."""
        return len(self.prompt_ids) + len(self.tokens) - 1

    def finish_reason_now(self, eos: frozenset[int], stopped: bool) -> str | None:
        """Why its newest token ends it (an EOS id, a completed stop string, its budget), or None."""
        if self.tokens[-1] in eos:
            return "eos"
        if stopped:
            return "stop"
        if len(self.tokens) >= self.budget:
            return "length"
        return None


def call_requests(prompts: Sequence[Sequence[int]], order: Sequence[int], budgets: Sequence[int], n: int, logprobs: bool) -> list[Request]:
    """A record per (prompt, sample), prompt-major in `order` (prompt indices): the queue of a call."""
    return [Request(p, s, prompts[p], budgets[p], logprobs=[] if logprobs else None) for p in order for s in range(n)]
