"""The persistent inputs of one captured decode step: every value the step reads that changes from step
to step lives in a tensor allocated once per (row bucket, column bucket) and written before each replay.

A captured graph replays the kernels it recorded on the addresses it recorded, so nothing the step reads
may be a Python value (it would be frozen at capture) or a tensor made anew per step (its address would
be stale). What the step reads, and where it lives:

- each row's next token and its position: `tokens`, `positions` [rows, 1] long;
- the column every row writes its new K/V to (the store's front): `column` [1] long;
- which columns each row attends to: `mask` [rows, 1, 1, columns], a copy of the store's `attend` for
  the live rows: additive (0 allowed) for transformers' SDPA, or boolean (True allowed) for the engine's
  attention kernel, which checks an additive mask's values on the host (a read a capture cannot hold);
- the K/V themselves: views of the store's own tensors (`keys`, `values`), written in place;
- the weights: read where they are (the graph holds their addresses), so in-place updates are seen.

Rows past the live count are padding: they feed `pad_token_id` at position 0 and attend to their own new
key only (column `front`), so every kernel computes finite values for them; their K/V land in cache rows
no live row owns (admission rewrites a row's columns before it is read) and their logits are dropped."""

from __future__ import annotations

import torch

from autobucket.engine.batching.static_cache import StaticKVCache


class StepBuffers:
    """One bucket's persistent inputs, over `store`'s first `rows` rows and `columns` columns."""

    def __init__(self, store: StaticKVCache, rows: int, columns: int, pad_token_id: int, boolean_mask: bool) -> None:
        device = store.attend.device
        self.store, self.rows, self.columns, self.pad_token_id = store, rows, columns, pad_token_id
        # the values of an allowed and a masked column in `mask`
        self.allowed, self.masked = (True, False) if boolean_mask else (0, store.masked_value)
        self.tokens = torch.full((rows, 1), pad_token_id, dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        dtype = torch.bool if boolean_mask else store.attend.dtype
        self.mask = torch.full((rows, 1, 1, columns), self.masked, dtype=dtype, device=device)
        # views of the store's tensors: the same storage for the store's lifetime (it never reallocates)
        self.keys = [k[:rows, :, :columns] for k in store.keys]
        self.values = [v[:rows, :, :columns] for v in store.values]

    def fill(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Write this step's values: `tokens`, `positions` [live] long on the device, the store's front and
        mask (device copies only; nothing is read back to the host)."""
        store, live = self.store, int(tokens.shape[0])
        front = store.front
        self.tokens[:live, 0].copy_(tokens)
        self.tokens[live:] = self.pad_token_id
        self.positions[:live, 0].copy_(positions)
        self.positions[live:] = 0
        self.column.fill_(front)
        attend = store.attend[:live, : self.columns]
        self.mask[:live, 0, 0].copy_(attend == 0 if self.mask.dtype == torch.bool else attend)
        self.mask[live:] = self.masked
        self.mask[live:, 0, 0, front] = self.allowed  # padding rows read their own new key: finite on any kernel

    def mask_view(self) -> torch.Tensor:
        """A new view object of `mask` per trace: kernels memoise work per mask object, and a capture must
        record that work rather than reuse what a warm-up computed."""
        return self.mask.view(self.mask.shape)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's K/V write: key, value [rows, kv_heads, 1, head_dim] into column `column` of the
        bucket's views, by index (a tensor), -> the layer's bucket views [rows, kv_heads, columns, head_dim]."""
        self.keys[layer].index_copy_(2, self.column, key)
        self.values[layer].index_copy_(2, self.column, value)
        return self.keys[layer], self.values[layer]
