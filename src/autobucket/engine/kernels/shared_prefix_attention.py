"""Decode attention over a shared prefix: rows that share a prefix (the n samples of one prompt, the
prompts of an admission that share a system prompt) keep a single
copy of the prompt's K/V, and each decode step attends to it once for all of them.

Without it, each of a prompt's n cache rows holds its own copy of the prompt's K/V, and a decode step
reads all n copies (n x the memory traffic, at GRPO's n = 8 most of a step). Here the cache rows hold
only what each sample generated; the prompt's K/V lives once in a `SharedPrefixes` group. A step's
attention for a row is the softmax over [shared prompt keys | own keys], computed in two parts and merged
by their softmax statistics (the standard split of a softmax over a concatenation):

    lse = logaddexp(lse_shared, lse_own)
    out = exp(lse_shared - lse) * out_shared + exp(lse_own - lse) * out_own

where out_part and lse_part are one part's softmax attention output and log-sum-exp of its scores.
The shared part is one flash-attention call for every group: the group's rows' queries (all their heads
that share a KV head) against the group's keys, `[groups, kv_heads, rows_in_group * heads_per_kv, shared]`.
The result equals attention over the concatenated keys up to floating-point rounding; the merge is fp32
whatever the model's dtype. Under `kernels="invariant"` the invariant kernel runs instead, each row
walking [shared keys | own keys] as one sequence (same 64-key blocks, same order), so the output is
bitwise a per-row copy's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autobucket.engine.intercept.attention import windows_applied
from autobucket.engine.intercept.functions import dropout_suppressed
from autobucket.engine.kernels.invariant_attention import (
    invariant_attention_shared,
    kernel_takes,
    shared_prefix_tiles,
)


@dataclass
class SharedPrefixLayout:
    """The step's grouping of cache rows onto shared prompts (rebuilt when rows or groups change).

    keys[l], values[l]: [groups, kv_heads, shared, head_dim], each group's prompt K/V left-aligned and
    zero-padded to the longest; shared_mask: [groups, shared] additive (0 = a real key, -inf = padding);
    row_group, row_slot: [rows] long, each row's group (-1: none) and its place among the group's rows."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    shared_mask: torch.Tensor
    shared_length: torch.Tensor  # [groups] long: each group's real keys
    row_group: torch.Tensor
    row_slot: torch.Tensor
    slots: int  # most rows in one group
    calls: int = 0  # layers that ran on this layout in the current step (checked by the runner)
    # per layer: the invariant kernel's tiles of keys[l] (`shared_prefix_tiles`), made at their first read and
    # kept with the stacked keys while the groups stay (made anew, every step would transpose every
    # layer's shared keys again, most of the shared-prefix attention's work); None: not kept (made per call). They hold
    # the shared keys once more in fp32 (bf16: keys and values), beside the n - 1 copies sharing saves
    tiles: list[torch.Tensor | None] | None = None

    def shared_tiles(self, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s shared keys as the kernel's tiles (an empty tensor where its build reads none)."""
        if self.tiles is None:
            return None
        if self.tiles[layer] is None:
            self.tiles[layer] = shared_prefix_tiles(self.keys[layer], self.values[layer], self.shared_length)
        return self.tiles[layer]


class SharedPrefixAttention:
    """transformers' attention-function interface for one decode forward over `layout`; `invariant`: on
    the batch-invariant kernel, which reads the shared keys first in the row's own key order (bitwise
    the per-row result), instead of two flash parts merged; `own_kernel` (the default kernels' decode):
    on that kernel too wherever it can take the call (faster than the flash parts on a GRPO-like call's
    decode, docs/benchmarks.md), else the flash parts. The decode step's kernel ops (`engine/decode/ops.py`) read `layout`
    and `invariant` to call the same kernel themselves."""

    def __init__(self, layout: SharedPrefixLayout, invariant: bool = False, own_kernel: bool = False) -> None:
        self.layout, self.invariant, self.own_kernel = layout, invariant, own_kernel

    def __call__(self, module: Any, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                 **kwargs) -> tuple[torch.Tensor, None]:
        if dropout and not dropout_suppressed():
            raise ValueError(f"shared-prefix decode attention got attention dropout {dropout}; the engine decodes in eval semantics")
        layout, layer = self.layout, module.layer_idx
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        # A sliding layer of a call past its window: the dispatcher narrowed the mask of the row's own keys
        # to the window; the shared keys the window still covers are the prompt's last (window - own).
        window = int(kwargs.get("sliding_window") or 0) if windows_applied() else 0
        if self.invariant and (query.device.type != "cpu" or _triton_forced(query)):
            from autobucket.engine.kernels.triton.shared_prefix_attention import (
                shared_prefix_decode_attention,
            )

            output = shared_prefix_decode_attention(
                query, key, value, attention_mask, scale, layout.keys[layer], layout.values[layer],
                layout.shared_length, layout.row_group, window,
            )
        elif self.invariant or (self.own_kernel and kernel_takes(query, key, attention_mask, dropout, kwargs)):
            output = invariant_attention_shared(
                query, key, value, attention_mask, scale, layout.keys[layer], layout.values[layer],
                layout.shared_length, layout.row_group, layout.shared_tiles(layer), window,
            )
        else:
            output = _attend(query, key, value, attention_mask, scale, layout, layer, window)
        layout.calls += 1
        return output, None


def _triton_forced(query: torch.Tensor) -> bool:
    """CPU tensors on the Triton set (the tests' `forced_on_cpu`, under Triton's interpreter)."""
    from autobucket.engine.intercept.active import active

    return query.device.type == "cpu" and active().triton_on_cpu


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (output, logsumexp), CPU


def _attention_part(query, key, value, mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One part's attention output and its queries' logsumexp: query [B, H, Lq, D], key / value
    [B, H, Lk, D], mask additive, broadcast to [B, H, Lq, Lk] -> ([B, H, Lq, D], [B, H, Lq] fp32). SDPA's
    flash kernel on a CPU (it returns the logsumexp); elsewhere (a GPU: the default kernels' shared-prefix attention runs
    here) the same in fp32 math, a decode step's one query per row being small."""
    if query.device.type == "cpu" and not _MATH_PARTS:
        return _FLASH(query, key, value, attn_mask=mask, scale=scale)[:2]
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None]).nan_to_num_(0.0)  # a query with no key: all weights 0
    return torch.matmul(weights, value.float()).to(query.dtype), lse


_MATH_PARTS = False  # tests: run the math form on a CPU too


def _attend(query, key, value, attention_mask, scale: float, layout: SharedPrefixLayout, layer: int,
            window: int = 0) -> torch.Tensor:
    """query [rows, heads, 1, head_dim]; key, value [rows, kv_heads, own, head_dim] (each row's own
    columns, masked by `attention_mask`) -> [rows, 1, heads, head_dim] in the query's dtype.

    Both parts run SDPA's flash kernel on a CPU, fp32 math elsewhere (`_attention_part`), each also
    giving its queries' logsumexp: the merge weights
    are exp(lse_part - lse_total). window > 0: the mask already holds the row's own keys inside the
    window; the shared part reads only the prompt's last (window - own) keys."""
    rows, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    per_kv = heads // kv_heads
    # A KV head's query heads become its "query positions": [rows, kv_heads, per_kv, head_dim] (GQA, no repeat)
    q = query.reshape(rows, kv_heads, per_kv, head_dim)
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, :]  # [rows, 1, 1, own]: the one query's row
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
        mask = mask.to(query.dtype)
    own_out, own_lse = _attention_part(q, key, value, mask, scale)
    first_shared = None
    if window:
        own = _own_keys_allowed(attention_mask, rows, key.shape[2]).to(layout.shared_length.device)
        lengths = layout.shared_length[layout.row_group.clamp(min=0)]
        first_shared = (lengths - (window - own)).clamp(min=0)  # [rows]: the first shared key in the window
    shared_out, shared_lse = _shared_part(q, scale, layout, layer, first_shared)
    total = torch.logaddexp(own_lse, shared_lse)  # [rows, kv_heads, per_kv]
    output = torch.exp(own_lse - total)[..., None] * own_out.float()
    output = output + torch.exp(shared_lse - total)[..., None] * shared_out
    return output.reshape(rows, heads, head_dim)[:, None].to(query.dtype)


def _own_keys_allowed(attention_mask: torch.Tensor | None, rows: int, columns: int) -> torch.Tensor:
    """[rows] long: the own columns each row's decode query may attend (its mask's last query row, the
    first head's: bool True or additive 0 / above dtype-min / 2 allowed; no mask: every column)."""
    if attention_mask is None:
        return torch.full((rows,), columns, dtype=torch.long)
    last = attention_mask[:, 0, -1, :columns]  # [rows | 1, columns]
    allowed = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
    return allowed.sum(-1).expand(rows)


def _shared_part(q: torch.Tensor, scale: float, layout: SharedPrefixLayout, layer: int,
                 first_shared: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: attention output (fp32) and logsumexp over its group's shared keys, [rows, kv_heads,
    per_kv, head_dim] and [rows, kv_heads, per_kv]; 0 and -inf for a row without a group, or whose
    window (first_shared [rows]: the first shared key a row reads; None: all) holds none of them."""
    rows, kv_heads, per_kv, head_dim = q.shape
    groups, shared = layout.keys[layer].shape[0], layout.keys[layer].shape[2]
    grouped = layout.row_group >= 0
    if first_shared is not None:
        grouped = grouped & (first_shared < layout.shared_length[layout.row_group.clamp(min=0)])
    where = (layout.row_group[grouped], layout.row_slot[grouped])
    # queries gathered per group: [groups, slots, kv_heads, per_kv, head_dim] -> [groups, kv_heads, slots * per_kv, head_dim]
    by_group = q.new_zeros((groups, layout.slots, kv_heads, per_kv, head_dim))
    by_group[where] = q[grouped]
    by_group = by_group.permute(0, 2, 1, 3, 4).reshape(groups, kv_heads, layout.slots * per_kv, head_dim)
    mask = layout.shared_mask[:, None, None, :].to(q.dtype)  # [groups, 1, 1, shared]: padding keys off
    if first_shared is not None:  # each slot's window: [groups, 1, slots * per_kv, shared]
        start = torch.zeros((groups, layout.slots), dtype=torch.long, device=q.device)
        start[where] = first_shared[grouped]
        before = torch.arange(shared, device=q.device) < start[..., None]  # [groups, slots, shared]
        before = before.repeat_interleave(per_kv, dim=1)[:, None]
        mask = mask.masked_fill(before, float("-inf"))
    out, lse = _attention_part(by_group, layout.keys[layer], layout.values[layer], mask, scale)
    out = out.reshape(groups, kv_heads, layout.slots, per_kv, head_dim).transpose(1, 2)
    lse = lse.reshape(groups, kv_heads, layout.slots, per_kv).transpose(1, 2)
    row_out = torch.zeros((rows, kv_heads, per_kv, head_dim), dtype=torch.float32, device=q.device)
    row_lse = torch.full((rows, kv_heads, per_kv), float("-inf"), dtype=torch.float32, device=q.device)
    row_out[grouped] = out[where].float()
    row_lse[grouped] = lse[where]
    return row_out, row_lse
