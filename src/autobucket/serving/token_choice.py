"""Each row's next token under its own request's selection, for rows of requests with different sampling
settings in one decode step.

Rows whose requests select alike (everything but the random stream's key) are chosen in one
`Selection.choose` call, keyed per row by its request's stream key, sample and step: the tokens and
logprobs `Rollout.generate` would choose for that request as prompt 0 of a call of its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from autobucket.serving.request import Request


def choose_tokens(requests: Sequence[Request], logits: torch.Tensor) -> tuple[torch.Tensor, list[float | None]]:
    """logits [rows, vocab] fp32 (row r is `requests[r]`'s) -> tokens [rows] long, logprobs per row."""
    tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
    logprobs: list[float | None] = [None] * len(requests)
    for selection, rows in _alike(requests).items():
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        keyed = _with_stream_keys(selection, [requests[r] for r in rows])
        steps = [requests[r].steps_before + len(requests[r].tokens) for r in rows]
        chosen, chosen_logprobs = keyed.choose(
            logits[index], None, list(range(len(rows))), [requests[r].sample for r in rows], steps
        )
        tokens[index] = chosen
        if chosen_logprobs is not None:
            for r, value in zip(rows, chosen_logprobs.tolist(), strict=True):
                logprobs[r] = value
    return tokens, logprobs


def _alike(requests: Sequence[Request]) -> dict:
    """Selection without its stream keys -> the rows whose requests select with it."""
    groups: dict = {}
    for row, request in enumerate(requests):
        groups.setdefault(request.selection, []).append(row)
    return groups


def _with_stream_keys(selection, requests: Sequence[Request]):
    sampler = dataclasses.replace(selection.sampler, request_seeds=tuple(r.stream_key for r in requests))
    return dataclasses.replace(selection, sampler=sampler)
