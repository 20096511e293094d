"""One copy of a prompt's K/V for every request with that prompt in flight, as a `Rollout.generate` call's
n samples of a prompt read one copy (shared-prefix decode attention, `kernels/shared_prefix_attention.py`).

Requests are keyed by their prompt ids alone: the n samples of a GRPO prompt submitted as n requests,
whether admitted together or one joining while its siblings run. Each `SharedPrompt` holds what its
requests need from the prompt's prefill: its last logits (a fresh request's first token is chosen from
them, so a sibling joining later needs no forward) and its K/V, held by the static cache as one shared
prefix once a row reads it. A row holds only its own columns after the prompt: the tokens it was resumed
with and those it makes.

Lifetime: a prompt's record lives while a row reads its copy. The store drops a copy when its last row
retires (`StaticKVCache.compact`), and `forget_unread` then drops the record; a re-prefill after a weight
update drops every row, so no copy or logits of old weights is ever read again."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autobucket.engine.batching.prefix_cache import PrefixHit
from autobucket.engine.batching.static_cache import StaticKVCache

KeyValues = tuple[list[torch.Tensor], list[torch.Tensor]]  # per layer [kv_heads, tokens, head_dim]


@dataclass
class SharedPrompt:
    """A prompt in flight: its last logits and its K/V, held by the store once a row reads it."""

    tokens: int  # the prompt's length
    last_logits: torch.Tensor  # [vocab] fp32: the logits after its last token
    key_values: KeyValues | None  # its K/V until a row reads it (then the store holds it: `copy`)
    copy: int | None = None  # the store's id of its shared prefix, once a row reads it

    def held(self) -> int | KeyValues:
        """What `ModelRunner.insert_sharing` takes: the held copy's id, or the K/V to hold."""
        if self.copy is not None:
            return self.copy
        assert self.key_values is not None, "a prompt's K/V is held by the store or by its record"
        return self.key_values

    def now_held(self, copy: int) -> None:
        """The store holds its K/V as shared prefix `copy` (the record keeps no second reference)."""
        self.copy, self.key_values = copy, None

    def hit(self, store: StaticKVCache | None) -> PrefixHit:
        """Its K/V as the prompt part of a continued prefill."""
        keys, values = store.shared_prefixes[self.copy] if self.copy is not None else self.held()
        return PrefixHit(self.tokens, list(keys), list(values))


class SharedPrompts(dict[tuple[int, ...], SharedPrompt]):
    """Prompt ids -> its record, for the prompts a row reads (or that are being admitted)."""

    def forget_unread(self, store: StaticKVCache | None) -> None:
        """Drop the records no row reads: made for an admission whose requests all ended at their first
        token, or whose copy the store dropped with its last row."""
        held = store.shared_prefixes if store is not None else {}
        for prompt in [p for p, shared in self.items() if shared.copy is None or shared.copy not in held]:
            del self[prompt]
