"""A preallocated KV cache for continuous batching, with one shared write front.

Layout: per layer, keys and values are `[rows, kv_heads, columns, head_dim]`. Every active row
is *right-aligned*: its last cached token sits at column `front - 1`, so a decode step writes all
rows' new K/V into the single column `front` and one index serves the whole batch. Rows of
different lengths therefore start at different columns; the columns a row does not own are
masked by `attend`, an additive mask `[rows, columns]` (0 = attend, dtype-min = masked) that the
decode step reads as a view, so no mask is rebuilt per step.

Why right-aligned and not left-aligned: a left-aligned row would write at its own column, i.e. a
scatter per step and a per-row read length. Right-aligned rows share one write and one
contiguous read `[:, :, :front + 1]`, attending only over what is filled (HF's StaticCache attends
over the whole buffer). The price is dead columns on the left; they are trimmed (shifted out)
when `trim()` is called or the front would pass the capacity.

Admission writes a prefilled group's K/V so that it ends at the front. A group wider than the
current front moves the front to the group's width instead of moving the old rows: the old rows
then have masked columns between their data and the front, which costs nothing to attend over.

The class keeps plain integer bookkeeping on the host (`first_column` per row) so that trimming
and capacity checks never need a device sync.

Shared prefixes (shared-prefix decode attention, `kernels/shared_prefix_attention.py`): the n samples of
a prompt, or the prompts continued from one prefix, can share one copy of its K/V, held beside the rows
(`add_shared_prefix`). Such rows own only the columns after it (`admit_sharing` admits them owning
nothing yet, or their own tails); `shared_prefix_layout()` tells the decode attention which rows read
which shared prefix. A shared prefix is dropped when its last row retires.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autobucket.engine.kernels.shared_prefix_attention import SharedPrefixLayout
from autobucket.engine.model_access.hf_compat import CacheLayerFace

try:  # transformers >= 4.56 has layered caches; both 4.57 and 5.x are supported.
    from transformers.cache_utils import Cache
except ImportError as error:  # pragma: no cover - guarded by the package's dependency pins
    raise ImportError("autobucket needs transformers >= 4.57 (layered KV caches)") from error


def fill_holes_order(survivors: Sequence[int]) -> list[int]:
    """A `StaticKVCache.compact` order for the surviving rows (ascending) that moves the fewest: survivors
    among the first len(survivors) rows stay where they are; the holes there take the survivors beyond.
    (Keeping the input order shifts every row after a hole: with rows retiring a few at a time, as
    per-request budgets and EOS make them, that moved GBs of K/V in a call.)"""
    kept, staying = len(survivors), set(survivors)
    beyond = iter(row for row in survivors if row >= kept)
    return [row if row in staying else next(beyond) for row in range(kept)]


class CacheCapacityError(ValueError):
    """The static cache cannot hold the next column even after trimming."""


class StaticKVCache:
    """Preallocated K/V storage for `rows` sequences of up to `columns` cached tokens each."""

    def __init__(
        self,
        num_layers: int,
        rows: int,
        kv_heads: int,
        columns: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        zero_filled: bool = True,
    ) -> None:
        shape = (rows, kv_heads, columns, head_dim)
        # Columns a row does not own are masked, but SDPA still reads them (masked scores times their
        # values): they must hold finite numbers, so the storage starts zeroed and retired rows are
        # cleared. zero_filled=False, for readers that never read a column its row does not own (the
        # engine's attention kernel), skips both: zeroing every layer's K/V on a fresh allocation faults in
        # and writes every page of it, and the columns never owned (most of a static cache's, on prompts of
        # mixed lengths) are then never touched at all.
        self.zero_filled = zero_filled
        allocate = torch.zeros if zero_filled else torch.empty
        # keys[l], values[l]: [rows, kv_heads, columns, head_dim]
        self.keys = [allocate(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [allocate(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.masked_value = torch.finfo(dtype).min
        # attend: [rows, columns] additive attention mask, 0 where a row owns the column.
        self.attend = torch.full((rows, columns), self.masked_value, dtype=dtype, device=device)
        self.rows = rows
        self.columns = columns
        self.active_rows = 0
        self.front = 0
        self.first_column: list[int] = []  # per active row: its first live column
        self.has_gap: list[bool] = []  # per active row: masked columns between its data and the front
        self.prefix_of: list[int] = []  # per active row: the shared prefix it reads first (-1: none)
        self.shared_prefixes: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # id -> per layer [kv_heads, tokens, head_dim]
        self._next_prefix = 0
        self._layout: SharedPrefixLayout | None = None  # rebuilt after rows or shared prefixes change
        self._stacked: tuple | None = None  # (shared prefix ids, their stacked K/V): see _stacked_prefixes
        self.trims = 0
        self.trimmed_columns = 0
        self.moved_bytes = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values, self.attend)) + self.shared_prefix_bytes

    @property
    def shared_prefix_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for keys, values in self.shared_prefixes.values() for t in (*keys, *values))

    @property
    def free_rows(self) -> int:
        return self.rows - self.active_rows

    def _column_bytes(self, rows: int, columns: int) -> int:
        per_layer = rows * self.keys[0].shape[1] * columns * self.keys[0].shape[3] * self.keys[0].element_size()
        return 2 * len(self.keys) * per_layer

    # ---------------------------------------------------------------- admission
    def admit(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        lengths: Sequence[int],
        always_trim: bool = False,
    ) -> range:
        """Copy a prefilled, left-padded group into free rows, right-aligned to the front.

        keys[l], values[l]: [group_rows, kv_heads, width, head_dim]; row b's real tokens are its last
        `lengths[b]` columns (the rest is left padding). Returns the rows it now occupies.
        """
        group_rows, width = keys[0].shape[0], keys[0].shape[2]
        if group_rows > self.free_rows:
            raise ValueError(f"cannot admit {group_rows} rows: only {self.free_rows} of {self.rows} are free")
        self._make_room_for(width, always_trim)
        first, last = self.active_rows, self.active_rows + group_rows
        left = self.front - width
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.keys[layer][first:last, :, left : self.front] = k
            self.values[layer][first:last, :, left : self.front] = v
        return self._own_columns(first, lengths)

    def admit_segments(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        segments: Sequence[tuple[int, int, int]],
        always_trim: bool = False,
    ) -> range:
        """Copy one K/V slice per new row, right-aligned to the front (packed or chunked prefills).

        keys[l], values[l]: [source_rows, kv_heads, width, head_dim]; new row j copies columns
        [start, end) of source row `segments[j] = (row, start, end)`. Returns the rows it now occupies.
        """
        if len(segments) > self.free_rows:
            raise ValueError(f"cannot admit {len(segments)} rows: only {self.free_rows} of {self.rows} are free")
        lengths = [end - start for _, start, end in segments]
        self._make_room_for(max(lengths), always_trim)
        first = self.active_rows
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            for offset, (row, start, end) in enumerate(segments):
                self.keys[layer][first + offset, :, self.front - (end - start) : self.front] = k[row, :, start:end]
                self.values[layer][first + offset, :, self.front - (end - start) : self.front] = v[row, :, start:end]
        return self._own_columns(first, lengths)

    def add_shared_prefix(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> int:
        """Hold one prompt's K/V (per layer [kv_heads, tokens, head_dim]) for rows to share; returns its id."""
        prefix, self._next_prefix = self._next_prefix, self._next_prefix + 1
        self.shared_prefixes[prefix] = (list(keys), list(values))
        return prefix

    def admit_sharing(self, prefix: int, count: int, own=None, always_trim: bool = False) -> range:
        """`count` rows that read `prefix`'s K/V first: owning no columns yet (a prompt's samples: their
        decode tokens come next), or with `own` = (keys, values, segments) their own columns after the
        shared prefix's tokens, copied as `admit_segments` does (the members of a shared prefix)."""
        if count > self.free_rows:
            raise ValueError(f"cannot admit {count} rows: only {self.free_rows} of {self.rows} are free")
        if own is not None:
            rows = self.admit_segments(*own, always_trim=always_trim)
        else:
            rows = self._own_columns(self.active_rows, [0] * count)
        self.prefix_of[-count:] = [prefix] * count
        return rows

    def shared_prefix_layout(self) -> SharedPrefixLayout:
        """Which active rows read which shared prefix, with their K/V stacked (see SharedPrefixLayout)."""
        if self._layout is None:
            self._layout = self._build_layout()
        self._layout.calls = 0
        return self._layout

    def _build_layout(self) -> SharedPrefixLayout:
        used = sorted({g for g in self.prefix_of if g >= 0})
        slot_of, rows_in = {g: i for i, g in enumerate(used)}, dict.fromkeys(used, 0)
        row_group, row_slot = [], []
        for prefix in self.prefix_of:
            row_group.append(slot_of.get(prefix, -1))
            row_slot.append(rows_in[prefix] if prefix >= 0 else 0)
            if prefix >= 0:
                rows_in[prefix] += 1
        keys, values, mask, lengths, tiles = self._stacked_prefixes(tuple(used))
        as_long = lambda values: torch.tensor(values, dtype=torch.long, device=self.attend.device)  # noqa: E731
        return SharedPrefixLayout(keys, values, mask, lengths, as_long(row_group), as_long(row_slot), max(rows_in.values()),
                             tiles=tiles)

    def _stacked_prefixes(self, used: tuple[int, ...]):
        """The shared prefixes' K/V stacked and zero-padded to the longest, per layer [groups, kv_heads, shared,
        head_dim], their padding mask and lengths. Kept while the set of shared prefixes stays the same: rows retire
        every few steps, and restacking would copy every shared prompt each time."""
        if self._stacked is not None and self._stacked[0] == used:
            return self._stacked[1]
        lengths = [self.shared_prefixes[g][0][0].shape[1] for g in used]
        device, dtype, longest = self.attend.device, self.keys[0].dtype, max(lengths)
        shape = (len(used), self.keys[0].shape[1], longest, self.keys[0].shape[3])
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.keys]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.keys]
        mask = torch.full((len(used), longest), float("-inf"), dtype=torch.float32, device=device)
        for slot, (prefix, length) in enumerate(zip(used, lengths, strict=True)):
            prefix_keys, prefix_values = self.shared_prefixes[prefix]
            for layer in range(len(self.keys)):
                keys[layer][slot, :, :length] = prefix_keys[layer]
                values[layer][slot, :, :length] = prefix_values[layer]
            mask[slot, :length] = 0.0
        # tiles: per layer, the invariant kernel's tiles of these keys, made at the first step that reads them
        tiles: list[torch.Tensor | None] = [None] * len(self.keys)
        stacked = (keys, values, mask, torch.tensor(lengths, dtype=torch.long, device=device), tiles)
        self._stacked = (used, stacked)
        return stacked

    def _own_columns(self, first: int, lengths: Sequence[int]) -> range:
        """Rows first.. now own their last `lengths` columns before the front."""
        self._layout = None
        last = first + len(lengths)
        self.attend[first:last] = self.masked_value
        for offset, length in enumerate(lengths):
            self.attend[first + offset, self.front - length : self.front] = 0
            self.first_column.append(self.front - length)
            self.has_gap.append(False)
            self.prefix_of.append(-1)
        self.active_rows = last
        return range(first, last)

    def _make_room_for(self, width: int, always_trim: bool) -> None:
        if width > self.columns:
            raise CacheCapacityError(
                f"a prefill of width {width} needs {width} cache columns but cache_capacity is "
                f"{self.columns}; raise cache_capacity (or leave it None to size it per call)"
            )
        # Trim before placing the group: a trim moves the front left, and the group must end at the
        # front that decode will then use.
        if always_trim or self.front + 1 > self.columns:
            self.trim()
        if width > self.front:
            # Old rows keep their columns; [old front, width) becomes masked gap for them.
            self.has_gap = [True] * self.active_rows
            self.front = width

    # ---------------------------------------------------------------- decode
    def prepare_step(self, always_trim: bool = False) -> None:
        """Open column `front` for the next decode step (trimming first when it would not fit)."""
        if always_trim or self.front >= self.columns:
            self.trim()
        if self.front >= self.columns:
            raise CacheCapacityError(
                f"the static KV cache is full: {self.active_rows} rows need {self.front + 1} columns but "
                f"cache_capacity is {self.columns}; raise cache_capacity or set trim_cache=True"
            )
        self.attend[: self.active_rows, self.front] = 0

    def step_mask(self) -> torch.Tensor | None:
        """Additive decode mask `[active_rows, 1, 1, front + 1]` (a view, nothing is copied), or None
        when every row owns every column up to the front: then there is nothing to mask, and SDPA runs
        its unmasked kernel, as HF `generate` does for an unpadded batch."""
        if not any(self.first_column) and not any(self.has_gap):
            return None
        return self.attend[: self.active_rows, None, None, : self.front + 1]

    def write_step(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one decode token per row at the front and return K/V up to it.

        key, value: [active_rows, kv_heads, 1, head_dim] -> views [active_rows, kv_heads, front + 1, head_dim].
        """
        n, front = self.active_rows, self.front
        self.keys[layer][:n, :, front : front + 1] = key
        self.values[layer][:n, :, front : front + 1] = value
        return self.keys[layer][:n, :, : front + 1], self.values[layer][:n, :, : front + 1]

    def finish_step(self) -> None:
        self.front += 1

    # ---------------------------------------------------------------- retirement
    def compact(self, keep: Sequence[int]) -> None:
        """Keep only rows `keep` (in that order) as rows 0..len(keep)-1 and clear the rest."""
        kept, before = len(keep), self.active_rows
        # Only the rows whose position changes are copied (the gather reads a copy first, so a source
        # may also be a destination): in `fill_holes_order`, at most one row per retired row.
        moved = [row for row in range(kept) if keep[row] != row]
        if moved:
            device = self.attend.device
            to = torch.tensor(moved, dtype=torch.long, device=device)
            source = torch.tensor([keep[row] for row in moved], dtype=torch.long, device=device)
            for tensor in (*self.keys, *self.values):
                tensor[to, :, : self.front] = tensor[source, :, : self.front]
            self.attend[to] = self.attend[source]
            self.moved_bytes += self._column_bytes(len(moved), self.front)
        if self.zero_filled:
            for tensor in (*self.keys, *self.values):
                tensor[kept:before, :, : self.front] = 0
        self.attend[kept:before] = self.masked_value
        self.first_column = [self.first_column[row] for row in keep]
        self.has_gap = [self.has_gap[row] for row in keep]
        self.prefix_of = [self.prefix_of[row] for row in keep]
        for prefix in set(self.shared_prefixes) - set(self.prefix_of):
            del self.shared_prefixes[prefix]  # its last row retired
        if self._stacked is not None and not set(self._stacked[0]) <= set(self.shared_prefixes):
            self._stacked = None  # holds a dropped shared prefix's copy
        self._layout = None
        self.active_rows = kept
        if kept == 0:
            self.front = 0

    def trim(self) -> int:
        """Shift all rows left past the columns no active row uses; returns the columns removed."""
        dead = min(self.first_column, default=self.front)
        if dead == 0:
            return 0
        n, live = self.active_rows, self.front - dead
        for tensor in (*self.keys, *self.values):
            # clone: source and destination overlap
            tensor[:n, :, :live] = tensor[:n, :, dead : self.front].clone()
        self.attend[:n, :live] = self.attend[:n, dead : self.front].clone()
        self.attend[:n, live:] = self.masked_value
        self.front = live
        self.first_column = [column - dead for column in self.first_column]
        self.trims += 1
        self.trimmed_columns += dead
        self.moved_bytes += self._column_bytes(n, live)
        return dead

    def hf_cache(self) -> Cache:
        """The transformers `Cache` the model's attention layers write decode steps through."""
        return _FrontCache(self)


class _FrontCache(Cache):
    """transformers `Cache` whose every layer writes at the store's shared front.

    The driver advances the front once per forward (`finish_step`), never inside `update`, or each
    layer would write a different column.
    """

    def __init__(self, store: StaticKVCache) -> None:
        super().__init__(layers=[CacheLayerFace(self, layer) for layer in range(len(store.keys))])
        self.store = store

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.store.write_step(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int | None = 0, *args, **kwargs) -> int:
        return self.store.front

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.store.front + 1, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.store.columns
