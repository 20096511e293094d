"""Each row's next token under its own request's selection, for rows of requests with different sampling
settings in one decode step.

Rows whose requests select alike (everything but the random stream's key) are chosen in one
`Selection.choose` call, keyed per row by its request's stream key, sample and step: the tokens and
logprobs `Rollout.generate` would choose for that request as prompt 0 of a call of its own.

The repetition penalty and per-sequence logits processors read only the row's own ids (its prompt, the
tokens it was resumed with and its own so far), so they hold exactly whatever else is in flight: the
penalty's `seen` mask is built from those ids, and a request with processors is chosen alone, as prompt 0
(the index `prefix_allowed_tokens_fn` is handed), as in a single-request `generate`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from autobucket.engine.selection import seen_tokens
from autobucket.serving.request import Request


def choose_tokens(requests: Sequence[Request], logits: torch.Tensor) -> tuple[torch.Tensor, list[float | None]]:
    """logits [rows, vocab] fp32 (row r is `requests[r]`'s) -> tokens [rows] long, logprobs per row."""
    tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
    logprobs: list[float | None] = [None] * len(requests)
    for selection, rows in _alike(requests).values():
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        members = [requests[r] for r in rows]
        keyed = _with_stream_keys(selection, members)
        steps = [request.steps_before + len(request.tokens) for request in members]
        histories = [row_history(request) for request in members] if selection.needs_histories else ()
        seen = seen_tokens([row_history(r) for r in members], logits.shape[-1], logits.device) if selection.uses_penalty else None
        chosen, chosen_logprobs = keyed.choose(
            logits[index], seen, list(range(len(rows))), [request.sample for request in members], steps, histories
        )
        tokens[index] = chosen
        if chosen_logprobs is not None:
            for r, value in zip(rows, chosen_logprobs.tolist(), strict=True):
                logprobs[r] = value
    return tokens, logprobs


def row_history(request: Request) -> list[int]:
    """The ids the penalty and processors read: everything the row has read, as a single-request
    `generate` of the request (resumed or not) hands its processors."""
    return request.context


def _alike(requests: Sequence[Request]) -> dict:
    """A group key -> (the selection without its stream keys, the rows whose requests select with it).
    A request with per-sequence processors is a group of its own (see the module docstring)."""
    groups: dict = {}
    for row, request in enumerate(requests):
        key = request.selection if request.selection.row_processors is None else ("alone", row)
        groups.setdefault(key, (request.selection, []))[1].append(row)
    return groups


def _with_stream_keys(selection, requests: Sequence[Request]):
    sampler = dataclasses.replace(selection.sampler, request_seeds=tuple(r.stream_key for r in requests))
    return dataclasses.replace(selection, sampler=sampler)
