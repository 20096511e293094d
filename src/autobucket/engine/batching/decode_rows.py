"""`DecodeRows`: what the device keeps per active cache row between decode steps, as one record.

Row r of every field belongs to cache row r of the `StaticKVCache`, and mirrors the host record of the
request in that row (`engine/request.py`: its newest token, that token's position, its seen ids); the
batcher writes it only where it admits, advances or retires those records. Appending, keeping a subset
(retirement compacts the cache rows in the same order) and advancing a step go through this one
record, so the fields can never drift apart. The row's first cache column stays with the cache:
compaction and trimming move columns, and the cache updates their bookkeeping in the same operation."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeRows:
    """Per active row, in cache-row order."""

    tokens: torch.Tensor  # [rows] long: the token fed at the next decode step
    positions: torch.Tensor  # [rows] long: its true position (prompt length + tokens generated - 1)
    seen: torch.Tensor | None  # [rows, vocab] bool: ids the row has seen (with a repetition penalty only)

    @classmethod
    def empty(cls, device: torch.device, vocab_size: int, track_seen: bool) -> DecodeRows:
        none = torch.empty(0, dtype=torch.long, device=device)
        seen = torch.empty((0, vocab_size), dtype=torch.bool, device=device) if track_seen else None
        return cls(none, none.clone(), seen)

    @property
    def count(self) -> int:
        return int(self.tokens.shape[0])

    def append(self, tokens: torch.Tensor, positions: torch.Tensor, seen: torch.Tensor | None) -> None:
        """New rows after the current ones (their cache rows were just admitted in the same order)."""
        self.tokens = torch.cat([self.tokens, tokens])
        self.positions = torch.cat([self.positions, positions])
        if self.seen is not None:
            assert seen is not None, "a penalty call admits rows with their seen ids"
            self.seen = torch.cat([self.seen, seen])

    def advance(self, tokens: torch.Tensor) -> None:
        """Feed `tokens` [rows] at the next step; they join each row's seen ids."""
        if self.seen is not None:
            self.seen[torch.arange(tokens.shape[0], device=tokens.device), tokens] = True
        self.tokens = tokens
        self.positions = self.positions + 1

    def keep(self, rows: torch.Tensor) -> None:
        """Only `rows` [kept] long (in order) stay, compacted to the front."""
        self.tokens, self.positions = self.tokens[rows], self.positions[rows]
        if self.seen is not None:
            self.seen = self.seen[rows]
