"""One copy of a prompt's K/V for the requests with that prompt in flight, as a `Rollout.generate` call's
n samples of a prompt read one copy (shared-prefix decode attention, `kernels/shared_prefix_attention.py`).

Requests are keyed by their prompt ids alone: the n samples of a GRPO prompt submitted as n requests,
whether admitted together or one joining while its siblings run. A request alone with its prompt keeps
its own copy in its row, as a prompt's single sample does in a `Rollout.generate` call: a shared copy
would only cost a restack of every shared prompt whenever one comes or goes. Once a second request of
the prompt is in flight, a copy is made (from the prompt's prefill, or from the first request's row) and
the later ones read it; the first keeps its own.

A `SharedPrompt` holds what a prompt's requests need from its prefill: its last logits (a fresh request's
first token is chosen from them, so a sibling joining later needs no forward) and the store's id of its
copy once one is made. Each row reading the copy holds only its own columns after the prompt: the tokens
it was resumed with and those it makes.

Lifetime: a record lives while a row of its prompt is in flight. The store drops a copy when its last
reader retires (`StaticKVCache.compact`); a re-prefill after a weight update drops every row and record,
so no copy or logits of old weights is ever read again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autobucket.engine.batching.prefix_cache import PrefixHit
from autobucket.engine.batching.static_cache import StaticKVCache
from autobucket.serving.request import Request

KeyValues = tuple[list[torch.Tensor], list[torch.Tensor]]  # per layer [kv_heads, tokens, head_dim]


@dataclass
class SharedPrompt:
    """A prompt in flight: its last logits, and its K/V as the store's copy or, while one is being made,
    the K/V to make it from."""

    tokens: int  # the prompt's length
    last_logits: torch.Tensor  # [vocab] fp32: the logits after its last token
    key_values: KeyValues | None = None  # during an admission: the K/V its copy is made from
    copy: int | None = None  # the store's id of its copy, once rows read one

    def held(self) -> int | KeyValues:
        """What `ModelRunner.insert_sharing` takes: the held copy's id, or the K/V to hold."""
        if self.copy is not None:
            return self.copy
        assert self.key_values is not None, "a prompt's K/V is held by the store or handed to its record"
        return self.key_values

    def now_held(self, copy: int) -> None:
        """The store holds its K/V as copy `copy` (the record keeps no second reference)."""
        self.copy, self.key_values = copy, None

    def hit(self, store: StaticKVCache | None) -> PrefixHit:
        """Its K/V as the prompt part of a continued prefill."""
        keys, values = store.shared_prefixes[self.copy] if self.copy is not None else self.held()
        return PrefixHit(self.tokens, list(keys), list(values))


class SharedPrompts(dict[tuple[int, ...], SharedPrompt]):
    """Prompt ids -> its record, for the prompts of the rows in flight."""

    def follow_rows(self, rows: Sequence[Request], store: StaticKVCache | None) -> None:
        """Keep the records of the prompts `rows` hold, each with its copy only while the store holds it
        (it drops a copy with its last reader) and no K/V of its own (those served an admission)."""
        in_flight = {request.prompt_key for request in rows}
        held = store.shared_prefixes if store is not None else {}
        for prompt in list(self):
            shared = self[prompt]
            if prompt not in in_flight:
                del self[prompt]
                continue
            shared.key_values = None
            if shared.copy is not None and shared.copy not in held:
                shared.copy = None
