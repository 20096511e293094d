"""Continuous batching on a `StaticKVCache`: admit, decode, retire, compact, refill.

One loop serves every CB route; routes differ only in `group_prompts`, which splits each
admission into prefill groups (equal-width: one padded group; aligned: one group per request;
auto: the planner's buckets). Each group is prefilled in one forward, its first token is chosen
from the prefill logits, and rows that are not already finished are copied right-aligned into the
cache. Decode runs all active rows in one forward per step with per-row position ids and the
cache's additive mask; the only host sync per step is reading the new tokens back (`tolist`), and
EOS / budget checks happen on those host integers."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from autobucket.generation_setup import ResolvedGeneration
from autobucket.hf_compat import ForwardSpec
from autobucket.logits import seen_tokens, select_greedy
from autobucket.prefill import prefill_group
from autobucket.profile import PhaseTimer, Profile
from autobucket.static_cache import Cache, StaticKVCache


@dataclass(frozen=True)
class CacheShape:
    rows: int  # continuous batch size (most active rows)
    columns: int  # cache capacity in token columns


# A route's admission policy: the admitted prompt indices -> prefill groups of prompt indices.
GroupPrompts = Callable[[Sequence[int]], list[list[int]]]


@dataclass
class Finished:
    tokens: list[int]
    reason: str  # "eos" | "length"


@dataclass
class _Row:
    """Host-side state of one active cache row."""

    index: int
    tokens: list[int] = field(default_factory=list)


@dataclass
class _DeviceRows:
    """Device-side per-row decode state, kept in cache-row order."""

    next_input: torch.Tensor  # [rows] token fed at the next decode step
    next_position: torch.Tensor  # [rows] true position of that token
    seen: torch.Tensor | None  # [rows, vocab] bool, only with a repetition penalty

    def select(self, keep: torch.Tensor) -> None:
        self.next_input = self.next_input[keep]
        self.next_position = self.next_position[keep]
        if self.seen is not None:
            self.seen = self.seen[keep]

    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, seen: torch.Tensor | None) -> None:
        self.next_input = torch.cat([self.next_input, tokens])
        self.next_position = torch.cat([self.next_position, positions])
        if self.seen is not None and seen is not None:
            self.seen = torch.cat([self.seen, seen])


class ContinuousBatcher:
    """Runs one `generate` call's CB schedule. Create one per call."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: ForwardSpec,
        generation: ResolvedGeneration,
        cache_shape: CacheShape,
        vocab_size: int,
        trim_cache: bool,
        profile: Profile,
        timer: PhaseTimer,
    ) -> None:
        self.model, self.spec, self.generation = model, spec, generation
        self.cache_shape, self.vocab_size, self.trim_cache = cache_shape, vocab_size, trim_cache
        self.profile, self.timer = profile, timer
        self.device = next(model.parameters()).device
        self.store: StaticKVCache | None = None  # sized from the first prefill's K/V shapes
        self.eos = frozenset(generation.eos_token_ids)
        self.use_penalty = generation.repetition_penalty != 1.0
        self.rows: list[_Row] = []
        self.state = _DeviceRows(
            torch.empty(0, dtype=torch.long, device=self.device),
            torch.empty(0, dtype=torch.long, device=self.device),
            torch.empty((0, vocab_size), dtype=torch.bool, device=self.device) if self.use_penalty else None,
        )
        self.cache: Cache | None = None
        self.finished: dict[int, Finished] = {}

    def run(self, prompts: Sequence[Sequence[int]], group_prompts: GroupPrompts) -> dict[int, Finished]:
        queue = deque(range(len(prompts)))
        while queue or self.rows:
            free_rows = self.cache_shape.rows - len(self.rows)
            if queue and free_rows:
                admitted = [queue.popleft() for _ in range(min(free_rows, len(queue)))]
                self._admit(prompts, admitted, group_prompts)
            if self.rows:
                self._decode_step()
        return self.finished

    # ------------------------------------------------------------ admission
    def _admit(self, prompts: Sequence[Sequence[int]], admitted: list[int], group_prompts: GroupPrompts) -> None:
        groups = group_prompts(admitted)
        self.profile.prefill_groups.append([list(g) for g in groups])
        # Widest group first: it sets the front, narrower groups then fit without a gap.
        for group in sorted(groups, key=lambda g: -max(len(prompts[i]) for i in g)):
            self._prefill_and_insert(group, [prompts[i] for i in group])

    def _prefill_and_insert(self, group: list[int], group_prompts: list[Sequence[int]]) -> None:
        with self.timer.phase("prefill_ms"):
            output = prefill_group(self.model, self.spec, group_prompts, self.generation.pad_token_id)
            seen = seen_tokens(group_prompts, self.vocab_size, self.device) if self.use_penalty else None
            first = select_greedy(output.last_logits, seen, self.generation.repetition_penalty)
        self.profile.prefill_forwards += 1
        self.profile.prefill_tokens += len(group) * max(len(p) for p in group_prompts)
        first_host = first.tolist()
        keep = [b for b, token in enumerate(first_host) if not self._finish_if_done(group[b], [token])]
        if not keep:
            return
        with self.timer.phase("cache_ms"):
            self._insert(group, group_prompts, output, first, seen, keep, first_host)

    def _insert(self, group, group_prompts, output, first, seen, keep, first_host) -> None:
        keys, values = output.keys, output.values
        if len(keep) < len(group):
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            keys, values = [k[index] for k in keys], [v[index] for v in values]
            first, seen = first[index], (seen[index] if seen is not None else None)
        lengths = [len(group_prompts[b]) for b in keep]
        if self.store is None:
            self._create_store(keys)
        self.store.admit(keys, values, lengths, always_trim=self.trim_cache)
        if seen is not None:
            seen[torch.arange(len(keep), device=self.device), first] = True
        positions = torch.tensor(lengths, dtype=torch.long, device=self.device)
        self.state.extend(first, positions, seen)
        self.rows.extend(_Row(group[b], [first_host[b]]) for b in keep)
        self.profile.max_active_rows = max(self.profile.max_active_rows, len(self.rows))

    def _create_store(self, keys: list[torch.Tensor]) -> None:
        # keys[l]: [group_rows, kv_heads, width, head_dim]; geometry is read off the model's own K/V.
        layer_keys = keys[0]
        self.store = StaticKVCache(
            num_layers=len(keys),
            rows=self.cache_shape.rows,
            kv_heads=layer_keys.shape[1],
            columns=self.cache_shape.columns,
            head_dim=layer_keys.shape[3],
            dtype=layer_keys.dtype,
            device=layer_keys.device,
        )
        self.cache = self.store.hf_cache()

    # ------------------------------------------------------------ decode
    @torch.inference_mode()
    def _decode_step(self) -> None:
        with self.timer.phase("cache_ms"):
            self.store.prepare_step(always_trim=self.trim_cache)
        with self.timer.phase("decode_ms"):
            output = self.model(
                input_ids=self.state.next_input[:, None],
                attention_mask=self.store.step_mask(),
                position_ids=self.state.next_position[:, None],
                use_cache=True,
                **{self.spec.cache_keyword: self.cache},
            )
            self.store.finish_step()
            tokens = select_greedy(output.logits[:, -1, :].float(), self.state.seen, self.generation.repetition_penalty)
            tokens_host = tokens.tolist()  # the one host sync of the step
        self.profile.decode_forwards += 1
        if self.state.seen is not None:
            self.state.seen[torch.arange(len(tokens_host), device=self.device), tokens] = True
        self.state.next_input = tokens
        self.state.next_position = self.state.next_position + 1
        keep = [row for row, token in enumerate(tokens_host) if not self._append(row, token)]
        if len(keep) < len(self.rows):
            with self.timer.phase("cache_ms"):
                self._retire(keep)

    def _append(self, row: int, token: int) -> bool:
        state = self.rows[row]
        state.tokens.append(token)
        return self._finish_if_done(state.index, state.tokens)

    def _finish_if_done(self, index: int, tokens: list[int]) -> bool:
        if tokens[-1] in self.eos:
            self.finished[index] = Finished(tokens, "eos")
        elif len(tokens) >= self.generation.max_new_tokens:
            self.finished[index] = Finished(tokens, "length")
        else:
            return False
        return True

    def _retire(self, keep: list[int]) -> None:
        self.store.compact(keep)
        self.state.select(torch.tensor(keep, dtype=torch.long, device=self.device))
        self.rows = [self.rows[row] for row in keep]
        if self.trim_cache:
            self.store.trim()
