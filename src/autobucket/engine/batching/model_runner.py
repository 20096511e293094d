"""The device side of continuous batching: prefill a group, insert its rows into the static cache,
run one decode forward. It never sees the queue, requests or finish rules (that is `batcher.py`), so
calibration, a compiled decode path and tests can drive exactly the engine's device work.

Per-row device state is one `DecodeRows` record in cache-row order, aligned with the
`StaticKVCache`'s active rows (next token, its position, and with a penalty the seen ids)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autobucket.engine.batching.chunked_prefill import prefill_chunked
from autobucket.engine.batching.continued_prefill import prefill_continued
from autobucket.engine.batching.decode_rows import DecodeRows
from autobucket.engine.batching.packed_prefill import packing_attention, prefill_packed
from autobucket.engine.batching.prefill import PrefillOutput, prefill_padded
from autobucket.engine.batching.prefix_cache import PrefixHit
from autobucket.engine.batching.static_cache import StaticKVCache
from autobucket.engine.compiled.compiled_decode import CompiledDecode, StepInputs
from autobucket.engine.decode import ops as decode_ops
from autobucket.engine.decode.captured import captured_decode_for
from autobucket.engine.decode.forms import CAPTURED, COMPILED, MODEL, decode_form
from autobucket.engine.decode.parts import LlamaParts
from autobucket.engine.decode.step import llama_decode_step
from autobucket.engine.intercept.attention import (
    AttentionFunction,
    engine_attention,
    kernel_attention_active,
)
from autobucket.engine.kernels.shared_prefix_attention import SharedPrefixAttention
from autobucket.engine.model_access.hf_compat import ForwardSpec
from autobucket.engine.selection import seen_tokens
from autobucket.planning.forms import CHUNKED, PACKED, PADDED

# Sharing a copy adds two attention kernels and a few gathers per layer and step, whatever the groups; it
# pays once the copies it avoids are large, and the gain grows with the columns saved (docs/benchmarks.md,
# shared-prefix decode).
SHARED_PREFIX_MIN_SAVED_COLUMNS = 4096


@dataclass(frozen=True)
class CacheShape:
    continuous_batch_size: int  # cache rows: most sequences decoded at once
    cache_capacity: int  # cache columns: most tokens a row can hold


@dataclass
class RowInsert:
    """Rows of one prefill to start decoding: which prefill row each new cache row copies, its first token."""

    source_rows: list[int]  # per new cache row: its prompt's row in the prefill output
    first_tokens: torch.Tensor  # [new_rows] long, the token each row feeds at its first decode step
    prompt_lengths: list[int]  # per new cache row: real tokens of its prompt
    seen: torch.Tensor | None  # [new_rows, vocab] bool (prompt + first token), with a penalty only


class ModelRunner:
    """Device work of one call's CB schedule on one `StaticKVCache` (created at the first insert)."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: ForwardSpec,
        cache_shape: CacheShape,
        pad_token_id: int,
        vocab_size: int,
        track_seen: bool,
        trim_cache: bool = False,
        compiled: CompiledDecode | None = None,
        shared_prefix: bool = False,
        samples_share_prompt: bool = False,
        decode_attention: AttentionFunction | None = None,
    ) -> None:
        self.model, self.spec, self.cache_shape = model, spec, cache_shape
        # The eager decode step's attention when not transformers' own (the default kernels' `decode_sdpa`)
        self.decode_attention = decode_attention
        # The Llama family's parts for the engine's own decode step (`engine/decode`), bitwise the model's
        # forward without transformers' per-layer Python; None: the model's forward.
        self.parts = LlamaParts.of(model)
        self.compiled = compiled  # the compiled decode step, or None: every step eager
        # the captured decode steps where the call's plan chose them (`engine/decode/captured.py`), or None
        self.captured = None if compiled is not None else captured_decode_for(model, self.parts, pad_token_id, decode_attention)
        self.decode_step = decode_form(self.parts is not None, compiled is not None, self.captured is not None)
        # Rows may read one shared copy of K/V (shared-prefix decode attention): a prefix shared inside an
        # admission, and with `samples_share_prompt` the samples of one prompt admitted together.
        self.shared_prefix = shared_prefix and compiled is None and self.captured is None
        self.samples_share_prompt = self.shared_prefix and samples_share_prompt
        self._prefix_groups: dict[int, int] = {}  # id(shared prefix hit) -> its store group
        self.num_layers = 0
        self.pad_token_id, self.vocab_size, self.trim_cache = pad_token_id, vocab_size, trim_cache
        self.device = next(model.parameters()).device
        self.store: StaticKVCache | None = None  # sized from the first prefill's K/V shapes
        self.cache = None  # the store's transformers Cache face
        self.rows = DecodeRows.empty(self.device, vocab_size, track_seen)

    @property
    def seen(self) -> torch.Tensor | None:
        """[rows, vocab] bool ids each active row has seen (None without a repetition penalty)."""
        return self.rows.seen

    @property
    def last_step_compiled(self) -> bool:
        """The last decode step compiled or captured a graph: its time is that, not a step's."""
        if self.captured is not None:
            return self.captured.last_step_captured
        return self.compiled is not None and self.compiled.last_step_compiled

    @property
    def active_rows(self) -> int:
        return self.rows.count

    # ------------------------------------------------------------ prefill and insert
    def prefill(
        self, prompts: Sequence[Sequence[int]], form: str = PADDED, chunk_tokens: int | None = None
    ) -> tuple[PrefillOutput, torch.Tensor | None]:
        """Prefill `prompts` in `form` -> their K/V and last logits, and `seen` [prompts, vocab] with a penalty.

        padded: one left-padded forward; packed: one forward of the prompts concatenated in one row;
        chunked: one prompt in forwards of at most `chunk_tokens` tokens."""
        if form == PACKED:
            output = prefill_packed(self.model, self.spec, prompts, packing_attention(self.model))
        elif form == CHUNKED:
            assert len(prompts) == 1 and chunk_tokens is not None, "a chunked prefill holds one prompt"
            output = prefill_chunked(self.model, self.spec, prompts[0], chunk_tokens)
        else:
            output = prefill_padded(self.model, self.spec, prompts, self.pad_token_id)
        seen = seen_tokens(prompts, self.vocab_size, self.device) if self.seen is not None else None
        return output, seen

    def prefill_continued(
        self, hits: Sequence[PrefixHit], prompts: Sequence[Sequence[int]], chunk_tokens: int | None
    ) -> tuple[PrefillOutput, torch.Tensor | None]:
        """Prefill `prompts` whose first `hits[b].tokens` tokens' K/V are cached: only the rest runs."""
        output = prefill_continued(self.model, self.spec, hits, prompts, self.pad_token_id, chunk_tokens)
        seen = seen_tokens(prompts, self.vocab_size, self.device) if self.seen is not None else None
        return output, seen

    def insert(self, output: PrefillOutput, rows: RowInsert) -> int:
        """Copy the prefill rows `rows.source_rows` right-aligned into free cache rows and queue their first
        tokens; samples of one prompt admitted together share one copy of its K/V when that is on.
        Returns how many rows read a shared copy."""
        self._open_store(output.keys)
        prefix_groups = self._shared_prefix_groups(output, rows)
        shared = {s: n for s, n in self._shared_sources(rows).items() if s not in prefix_groups}
        groups = {source: self.store.add_shared_prefix(*output.prompt_key_values(source, length, 0, copy=True))
                  for source, length in shared.items()}
        groups.update(prefix_groups)
        # Admit in order: runs of plain rows (copied), of one prompt's samples (nothing copied), of one
        # shared prefix's members (their own columns after the prefix copied).
        index, grouped = 0, 0
        for group, run in itertools.groupby(rows.source_rows, key=groups.get):
            span = slice(index, index + len(list(run)))
            sources = rows.source_rows[span]
            if group is None:
                self._admit_plain(output, sources, rows.prompt_lengths[span])
            elif sources[0] in prefix_groups:
                width, prefix = output.keys[0].shape[2], output.shared_prefixes[sources[0]].tokens
                own = [(b, width - (length - prefix), width) for b, length in zip(sources, rows.prompt_lengths[span], strict=True)]
                self.store.admit_sharing(group, len(sources), (output.keys, output.values, own))
            else:
                self.store.admit_sharing(group, len(sources))
            grouped += 0 if group is None else len(sources)
            index = span.stop
        positions = torch.tensor(rows.prompt_lengths, dtype=torch.long, device=self.device)
        self.rows.append(rows.first_tokens, positions, rows.seen)
        return grouped

    def insert_sharing(self, prefix: int | tuple[list[torch.Tensor], list[torch.Tensor]], rows: RowInsert, own=None) -> int:
        """Start rows that read one shared copy of a prompt's K/V before their own columns: `prefix` is the
        store's id of a copy it holds, or the prompt's K/V (per layer [kv_heads, tokens, head_dim]) to hold as
        a new copy; `own` = (keys, values, segments) each row's own columns after the prompt, as
        `StaticKVCache.admit_sharing` copies them (None: the rows own none yet). Returns the copy's id."""
        if isinstance(prefix, int):
            assert self.store is not None and prefix in self.store.shared_prefixes, "a held copy's id"
        else:
            self._open_store(own[0] if own is not None else [k[None] for k in prefix[0]])
            prefix = self.store.add_shared_prefix(*prefix)
        self.store.admit_sharing(prefix, len(rows.source_rows), own, always_trim=self.trim_cache)
        positions = torch.tensor(rows.prompt_lengths, dtype=torch.long, device=self.device)
        self.rows.append(rows.first_tokens, positions, rows.seen)
        return prefix

    def _open_store(self, keys: list[torch.Tensor]) -> None:
        """The static cache, made at the first insert from its K/V's geometry (keys[l]: [rows, kv_heads, width, head_dim])."""
        if self.store is None:
            self.store = self._create_store(keys)
            self.cache = self.store.hf_cache()
            self.num_layers = len(keys)

    def _shared_prefix_groups(self, output: PrefillOutput, rows: RowInsert) -> dict[int, int]:
        """Source rows continued from a prefix shared inside the call -> the group holding that prefix's
        K/V once, when the copies it saves are large (or the group exists already, from an earlier
        admission of this call)."""
        if not self.shared_prefix or output.shared_prefixes is None:
            return {}
        members: dict[int, list[int]] = {}
        for source in rows.source_rows:
            hit = output.shared_prefixes[source]
            if hit is not None:
                members.setdefault(id(hit), []).append(source)
        groups = {}
        for key, sources in members.items():
            hit = output.shared_prefixes[sources[0]]
            group = self._prefix_groups.get(key)
            if group not in self.store.shared_prefixes:
                if (len(sources) - 1) * hit.tokens < SHARED_PREFIX_MIN_SAVED_COLUMNS:
                    continue
                group = self._prefix_groups[key] = self.store.add_shared_prefix(hit.keys, hit.values)
            groups.update(dict.fromkeys(sources, group))
        return groups

    def _shared_sources(self, rows: RowInsert) -> dict[int, int]:
        """Source rows whose prompt goes to several cache rows now (-> its length), when sharing is on."""
        if not self.samples_share_prompt:
            return {}
        counts: dict[int, int] = {}
        for source in rows.source_rows:
            counts[source] = counts.get(source, 0) + 1
        lengths = dict(zip(rows.source_rows, rows.prompt_lengths, strict=True))
        return {source: lengths[source] for source, count in counts.items() if count > 1}

    def _admit_plain(self, output: PrefillOutput, source_rows: list[int], lengths: list[int]) -> None:
        keys, values = output.keys, output.values
        if output.segments is not None:
            segments = [output.segments[b] for b in source_rows]
            self.store.admit_segments(keys, values, segments, always_trim=self.trim_cache)
            return
        if source_rows != list(range(keys[0].shape[0])):
            # Some rows finished at their first token, or samples share a prompt's row: gather (a copy).
            index = torch.tensor(source_rows, dtype=torch.long, device=self.device)
            keys, values = [k[index] for k in keys], [v[index] for v in values]
        self.store.admit(keys, values, lengths, always_trim=self.trim_cache)

    def _create_store(self, keys: list[torch.Tensor]) -> StaticKVCache:
        # keys[l]: [rows, kv_heads, width, head_dim]; geometry is read off the model's own K/V.
        columns = self.cache_shape.cache_capacity
        return StaticKVCache(
            num_layers=len(keys),
            rows=self.cache_shape.continuous_batch_size,
            kv_heads=keys[0].shape[1],
            columns=self.compiled.capacity(columns) if self.compiled is not None else columns,
            head_dim=keys[0].shape[3],
            dtype=keys[0].dtype,
            device=keys[0].device,
            # every read of the cache is then the invariant kernel, which skips columns a row does not own
            zero_filled=not (kernel_attention_active() and self.compiled is None),
        )

    # ------------------------------------------------------------ decode
    def prepare_decode(self) -> None:
        """Open the next cache column (trimming first when it would not fit)."""
        self.store.prepare_step(always_trim=self.trim_cache)

    def decode_logits(self) -> torch.Tensor:
        """One forward of every active row's next token -> last logits [rows, vocab] fp32, in the form
        chosen at construction (`decode_step`); a compiled step it cannot take runs eagerly."""
        logits = None
        if self.decode_step == COMPILED:
            inputs = StepInputs(self.rows.tokens, self.rows.positions, self.store, self.pad_token_id, self.parts)
            logits = self.compiled.step(inputs)
        elif self.decode_step == CAPTURED:
            logits = self.captured.step(self.store, self.rows.tokens, self.rows.positions)
        if logits is None:
            logits = self._eager_step()[:, -1, :].float()
        self.store.finish_step()
        return logits

    def _eager_step(self) -> torch.Tensor:
        """Logits [rows, 1, vocab] of one eager step, its attention overridden where rows read a shared
        prefix or the default kernels attend on the engine's kernel (the model's forward and the engine's
        step reach the override alike: the dispatcher, or the ops' own kernel call)."""
        layout = self.store.shared_prefix_layout() if self.store.shared_prefixes else None
        if layout is not None:
            override = SharedPrefixAttention(layout, kernel_attention_active(), self.decode_attention is not None)
        else:
            override = self.decode_attention
        with engine_attention(override) if override is not None else contextlib.nullcontext():
            if self.parts is None or self.decode_step == MODEL:
                logits = self._model_step()
            else:  # ENGINE, or a COMPILED step run eagerly
                logits = self._engine_step(layout is not None)
        if layout is not None and layout.calls != self.num_layers:  # a layer bypassed the dispatcher
            raise RuntimeError(
                f"shared-prefix decode attention ran in {layout.calls} of {self.num_layers} layers: this model's "
                "attention does not go through transformers' attention interface; report this model"
            )
        return logits

    def _engine_step(self, shared_prefix: bool) -> torch.Tensor:
        """The engine's Llama-family step on this step's ops (`decode_ops`: the one place that decides)."""
        tokens, positions, mask = self.rows.tokens[:, None], self.rows.positions[:, None], self.store.step_mask()
        ops = decode_ops.decode_ops(self.parts, mask, positions)
        return llama_decode_step(self.parts, ops, tokens, positions, self.store.write_step, shared_prefix)

    def _model_step(self) -> torch.Tensor:
        """The model's forward of every active row's next token -> logits [rows, 1, vocab]."""
        tokens, positions, mask = self.rows.tokens[:, None], self.rows.positions[:, None], self.store.step_mask()
        output = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self.spec.cache_keyword: self.cache},
        )
        return output.logits

    def advance(self, tokens: torch.Tensor) -> None:
        """Feed `tokens` [rows] at the next step; they join each row's seen tokens."""
        self.rows.advance(tokens)

    def row_key_values(self, row: int, start: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Cache row `row`'s K/V from its token `start` on, in token order (its owned columns; a gap
        skipped), per layer `[kv_heads, tokens - start, head_dim]` copies."""
        store = self.store
        columns = (store.attend[row, : store.front] == 0).nonzero().squeeze(1)
        keys, values = [k[row, :, columns] for k in store.keys], [v[row, :, columns] for v in store.values]
        group = store.prefix_of[row]
        if group >= 0:  # the shared prompt's K/V comes first
            group_keys, group_values = store.shared_prefixes[group]
            keys = [torch.cat([g, k], dim=1) for g, k in zip(group_keys, keys, strict=True)]
            values = [torch.cat([g, v], dim=1) for g, v in zip(group_values, values, strict=True)]
        return [k[:, start:] for k in keys], [v[:, start:] for v in values]

    def retire(self, keep: list[int]) -> None:
        """Keep only cache rows `keep` (in order), compacted to the front rows."""
        self.store.compact(keep)
        self.rows.keep(torch.tensor(keep, dtype=torch.long, device=self.device))
        if self.trim_cache:
            self.store.trim()
