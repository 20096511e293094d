"""Continuous batching on a `StaticKVCache`: admit, decode, retire, compact, refill.

One loop serves every CB route; routes differ only in `group_prompts`, which splits each
admission's prompts into prefill groups (equal-width: one padded group; aligned: one group per
prompt; auto: the planner's buckets).

Work items are (prompt, sample) pairs, queued prompt-major. A prompt is prefilled once; its K/V
and last-token logits serve all of its `n` samples: each sample draws its own first token from the
shared logits, and the K/V is copied into one cache row per sample. When an admission ends in the
middle of a prompt's samples, that prompt's prefill is kept (`_Retained`) for the next admission,
so a prompt is never prefilled twice.

Decode runs all active rows in one forward per step with per-row position ids and the cache's
additive mask; the only host sync per step is reading the new tokens back (`tolist`), and EOS /
budget checks happen on those host integers."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from autobucket.generation_setup import ResolvedGeneration
from autobucket.hf_compat import ForwardSpec
from autobucket.logits import apply_repetition_penalty, seen_tokens
from autobucket.prefill import PrefillOutput, prefill_group
from autobucket.profile import PhaseTimer, Profile
from autobucket.sampling import SamplerSettings, select_tokens
from autobucket.static_cache import Cache, StaticKVCache


@dataclass(frozen=True)
class CacheShape:
    rows: int  # continuous batch size (most active rows)
    columns: int  # cache capacity in token columns


@dataclass(frozen=True)
class Selection:
    """How every route turns logits into tokens for one call."""

    sampler: SamplerSettings
    repetition_penalty: float
    want_logprobs: bool

    def choose(self, logits, seen, prompts, samples, steps):
        """logits [rows, vocab] fp32 -> (tokens [rows], logprobs [rows] | None)."""
        if seen is not None and self.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, seen, self.repetition_penalty)
        return select_tokens(logits, self.sampler, prompts, samples, steps, self.want_logprobs)


# A route's admission policy: the admission's prompt indices -> prefill groups of prompt indices.
GroupPrompts = Callable[[Sequence[int]], list[list[int]]]


@dataclass
class Finished:
    tokens: list[int]
    reason: str  # "eos" | "length"
    logprobs: list[float] | None = None


@dataclass
class _Row:
    """Host-side state of one active cache row: one sample of one prompt."""

    prompt: int
    sample: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None


@dataclass
class _Source:
    """Where an admitted prompt's prefill lives: row `row` of `output`."""

    output: PrefillOutput
    row: int
    seen: torch.Tensor | None  # [vocab] bool prompt tokens (with a repetition penalty)


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
        selection: Selection,
        cache_shape: CacheShape,
        vocab_size: int,
        trim_cache: bool,
        profile: Profile,
        timer: PhaseTimer,
    ) -> None:
        self.model, self.spec, self.generation, self.selection = model, spec, generation, selection
        self.cache_shape, self.vocab_size, self.trim_cache = cache_shape, vocab_size, trim_cache
        self.profile, self.timer = profile, timer
        self.device = next(model.parameters()).device
        self.store: StaticKVCache | None = None  # sized from the first prefill's K/V shapes
        self.cache: Cache | None = None
        self.eos = frozenset(generation.eos_token_ids)
        self.use_penalty = generation.repetition_penalty != 1.0
        self.rows: list[_Row] = []
        self.state = _DeviceRows(
            torch.empty(0, dtype=torch.long, device=self.device),
            torch.empty(0, dtype=torch.long, device=self.device),
            torch.empty((0, vocab_size), dtype=torch.bool, device=self.device) if self.use_penalty else None,
        )
        self.retained: tuple[int, _Source] | None = None  # a prompt with samples still queued
        self.finished: dict[tuple[int, int], Finished] = {}

    @torch.inference_mode()
    def run(
        self, prompts: Sequence[Sequence[int]], samples_per_prompt: int, group_prompts: GroupPrompts
    ) -> dict[tuple[int, int], Finished]:
        """Finished results keyed by (prompt index, sample index)."""
        queue = deque((p, s) for p in range(len(prompts)) for s in range(samples_per_prompt))
        while queue or self.rows:
            free_rows = self.cache_shape.rows - len(self.rows)
            if queue and free_rows:
                admitted = [queue.popleft() for _ in range(min(free_rows, len(queue)))]
                still_queued = queue[0][0] if queue else None
                self._admit(prompts, admitted, still_queued, group_prompts)
            if self.rows:
                self._decode_step()
        return self.finished

    # ------------------------------------------------------------ admission
    def _admit(self, prompts, admitted: list[tuple[int, int]], still_queued: int | None, group_prompts) -> None:
        sources: dict[int, _Source] = {}
        if self.retained is not None:
            sources[self.retained[0]] = self.retained[1]
        new_prompts = list(dict.fromkeys(p for p, _ in admitted if p not in sources))
        groups = group_prompts(new_prompts) if new_prompts else []
        self.profile.prefill_groups.append([list(g) for g in groups])
        # Widest group first: it sets the front, narrower groups then fit without a gap.
        for group in sorted(groups, key=lambda g: -max(len(prompts[i]) for i in g)):
            sources.update(self._prefill(group, [prompts[i] for i in group]))
        by_source: dict[int, list[tuple[int, int]]] = {}
        for item in admitted:
            by_source.setdefault(id(sources[item[0]].output), []).append(item)
        for items in by_source.values():
            self._start_samples(prompts, items, sources)
        self.retained = (still_queued, sources[still_queued]) if still_queued in sources else None

    def _prefill(self, group: list[int], group_prompts: list[Sequence[int]]) -> dict[int, _Source]:
        with self.timer.phase("prefill_ms"):
            output = prefill_group(self.model, self.spec, group_prompts, self.generation.pad_token_id)
            seen = seen_tokens(group_prompts, self.vocab_size, self.device) if self.use_penalty else None
        self.profile.prefill_forwards += 1
        self.profile.prefill_tokens += len(group) * max(len(p) for p in group_prompts)
        return {p: _Source(output, b, None if seen is None else seen[b]) for b, p in enumerate(group)}

    def _start_samples(self, prompts, items: list[tuple[int, int]], sources: dict[int, _Source]) -> None:
        """First tokens of `items` (all prefilled in one output) from the shared prefill logits."""
        output = sources[items[0][0]].output
        source_rows_host = [sources[p].row for p, _ in items]
        source_rows = torch.tensor(source_rows_host, dtype=torch.long, device=self.device)
        seen = torch.stack([sources[p].seen for p, _ in items]) if self.use_penalty else None
        with self.timer.phase("prefill_ms"):
            tokens, logprobs = self.selection.choose(
                output.last_logits[source_rows], seen, [p for p, _ in items], [s for _, s in items], [0] * len(items)
            )
        tokens_host = tokens.tolist()
        logprobs_host = logprobs.tolist() if logprobs is not None else [None] * len(items)
        keep = []
        for b, ((p, s), token, logprob) in enumerate(zip(items, tokens_host, logprobs_host, strict=True)):
            row = _Row(p, s, [token], None if logprob is None else [logprob])
            if not self._finish_if_done(row):
                keep.append((b, row))
        if keep:
            with self.timer.phase("cache_ms"):
                self._insert(prompts, output, source_rows_host, tokens, seen, keep)

    def _insert(self, prompts, output: PrefillOutput, source_rows_host: list[int], tokens, seen, keep) -> None:
        index = torch.tensor([b for b, _ in keep], dtype=torch.long, device=self.device)
        rows_host = [source_rows_host[b] for b, _ in keep]  # per kept sample: its prompt's prefill row
        keys, values = output.keys, output.values
        if rows_host != list(range(keys[0].shape[0])):
            # Some rows finished at their first token, or samples share a prompt's row: gather (a copy).
            rows = torch.tensor(rows_host, dtype=torch.long, device=self.device)
            keys, values = [k[rows] for k in keys], [v[rows] for v in values]
        if self.store is None:
            self._create_store(keys)
        lengths = [len(prompts[row.prompt]) for _, row in keep]
        self.store.admit(keys, values, lengths, always_trim=self.trim_cache)
        first, seen = tokens[index], (seen[index] if seen is not None else None)
        if seen is not None:
            seen[torch.arange(len(keep), device=self.device), first] = True
        self.state.extend(first, torch.tensor(lengths, dtype=torch.long, device=self.device), seen)
        self.rows.extend(row for _, row in keep)
        self.profile.max_active_rows = max(self.profile.max_active_rows, len(self.rows))

    def _create_store(self, keys: list[torch.Tensor]) -> None:
        # keys[l]: [rows, kv_heads, width, head_dim]; geometry is read off the model's own K/V.
        self.store = StaticKVCache(
            num_layers=len(keys),
            rows=self.cache_shape.rows,
            kv_heads=keys[0].shape[1],
            columns=self.cache_shape.columns,
            head_dim=keys[0].shape[3],
            dtype=keys[0].dtype,
            device=keys[0].device,
        )
        self.cache = self.store.hf_cache()

    # ------------------------------------------------------------ decode
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
            tokens, logprobs = self.selection.choose(
                output.logits[:, -1, :].float(), self.state.seen, *self._stream_keys()
            )
            tokens_host = tokens.tolist()  # the one host sync of the step
            logprobs_host = logprobs.tolist() if logprobs is not None else None
        self.profile.decode_forwards += 1
        if self.state.seen is not None:
            self.state.seen[torch.arange(len(tokens_host), device=self.device), tokens] = True
        self.state.next_input = tokens
        self.state.next_position = self.state.next_position + 1
        keep = [r for r, token in enumerate(tokens_host) if not self._append(r, token, logprobs_host)]
        if len(keep) < len(self.rows):
            with self.timer.phase("cache_ms"):
                self._retire(keep)

    def _stream_keys(self) -> tuple[list[int], list[int], list[int]]:
        """(prompt, sample, step) per row: the sampler's stream keys; greedy selection needs none."""
        if self.selection.sampler.greedy:
            return [], [], []
        rows = self.rows
        return [row.prompt for row in rows], [row.sample for row in rows], [len(row.tokens) for row in rows]

    def _append(self, r: int, token: int, logprobs_host: list[float] | None) -> bool:
        row = self.rows[r]
        row.tokens.append(token)
        if logprobs_host is not None:
            row.logprobs.append(logprobs_host[r])
        return self._finish_if_done(row)

    def _finish_if_done(self, row: _Row) -> bool:
        if row.tokens[-1] in self.eos:
            reason = "eos"
        elif len(row.tokens) >= self.generation.max_new_tokens:
            reason = "length"
        else:
            return False
        self.finished[(row.prompt, row.sample)] = Finished(row.tokens, reason, row.logprobs)
        return True

    def _retire(self, keep: list[int]) -> None:
        self.store.compact(keep)
        self.state.select(torch.tensor(keep, dtype=torch.long, device=self.device))
        self.rows = [self.rows[r] for r in keep]
        if self.trim_cache:
            self.store.trim()
