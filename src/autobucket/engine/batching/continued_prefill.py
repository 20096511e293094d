"""Continued prefill: prompts whose first tokens' K/V came from the prefix cache prefill only the rest,
as queries attending to the cached prefix (the chunked prefill's path, with the prefix given).

One forward serves a group, over one K/V buffer per layer that already has the padded prefill's layout:
each row right-aligned in `width` columns (the longest prompt), its cached prefix then its suffix,

    row b: [pad .. pad | prefix_b | suffix_b]        (width columns)
    input: [pad .. pad | suffix_b]                   (the last `new` columns: suffixes left-padded)

so the input's column j maps to buffer column width - new + j for every row. The cache the model writes
through (`_ContinuationCache`) stores a new K/V only where the row's input token is real: a padding
token's column may hold the row's prefix, which it must not overwrite. Each query gets a 4-D mask of
exactly its row's prefix and the suffix up to itself (a padding query: its row's first key, so no row is
empty), and position ids `prefix_b + j`, so each real token sees its true position and exactly the keys
before it, as in a one-shot prefill of the whole prompt. A suffix longer than the token budget runs in
column chunks, each attending to what the previous ones wrote.

The buffer is the output: the cache admits it as one block, as it does a padded prefill. Before, the
prefixes sat in a DynamicCache of their own right-aligned columns, every forward concatenated it with the
new K/V, and the result was gathered into this layout: three more copies of every layer's K/V per turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from autobucket.engine.batching.prefill import PrefillOutput
from autobucket.engine.batching.prefix_cache import PrefixHit
from autobucket.engine.intercept.attention import kernel_attention_active
from autobucket.engine.intercept.grad_mode import without_autograd
from autobucket.engine.model_access.hf_compat import CacheLayerFace, ForwardSpec


class _ContinuationCache(Cache):
    """transformers `Cache` over the group's buffers: a forward of input columns [start, end) writes its real
    tokens' K/V into buffer columns first + [start, end) and attends over columns [0, first + end)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], real: torch.Tensor) -> None:
        super().__init__(layers=[CacheLayerFace(self, layer) for layer in range(len(keys))])
        self.buffers = (keys, values)  # per layer [rows, kv_heads, width, head_dim]
        self.real = real  # [rows, new] bool: the input column holds a token of the row's suffix
        self.first = keys[0].shape[2] - real.shape[1]  # buffer column of input column 0
        self.start = self.end = 0

    def chunk(self, start: int, end: int) -> None:
        """The next forward runs input columns [start, end)."""
        self.start, self.end = start, end

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        columns = slice(self.first + self.start, self.first + self.end)
        real = self.real[:, None, self.start : self.end, None]  # [rows, 1, chunk, 1]
        keys, values = self.buffers[0][layer_idx], self.buffers[1][layer_idx]
        keys[:, :, columns] = torch.where(real, key_states, keys[:, :, columns])
        values[:, :, columns] = torch.where(real, value_states, values[:, :, columns])
        return keys[:, :, : columns.stop], values[:, :, : columns.stop]

    def get_seq_length(self, layer_idx: int | None = 0, *args, **kwargs) -> int:
        return self.first + self.start

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.first + self.end, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.buffers[0][0].shape[2]


def _buffers(hits: Sequence[PrefixHit], prompts: Sequence[Sequence[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer K and V [rows, kv_heads, width, head_dim], each row's prefix placed before its suffix's
    columns. Zero-filled unless the engine's attention kernel reads them, which never reads a column
    outside a query's keys (SDPA reads the masked ones too: they must be finite)."""
    width = max(len(p) for p in prompts)
    allocate = torch.empty if kernel_attention_active() else torch.zeros
    template = hits[0].keys[0]  # [kv_heads, tokens, head_dim]
    shape = (len(prompts), template.shape[0], width, template.shape[2])
    keys, values = [], []
    for layer in range(len(hits[0].keys)):
        layer_keys = allocate(shape, dtype=template.dtype, device=template.device)
        layer_values = allocate(shape, dtype=template.dtype, device=template.device)
        for row, (prompt, hit) in enumerate(zip(prompts, hits, strict=True)):
            begin = width - len(prompt)
            layer_keys[row, :, begin : begin + hit.tokens] = hit.keys[layer]
            layer_values[row, :, begin : begin + hit.tokens] = hit.values[layer]
        keys.append(layer_keys)
        values.append(layer_values)
    return keys, values


def _layout(
    hits: Sequence[PrefixHit], prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [rows, new] (suffixes left-padded), real [rows, new] bool, position ids [rows, new], and
    each row's first buffer column [rows] (where its prefix starts)."""
    width = max(len(p) for p in prompts)
    new = max(len(p) - hit.tokens for p, hit in zip(prompts, hits, strict=True))
    input_ids = torch.full((len(prompts), new), pad_token_id, dtype=torch.long)
    real = torch.zeros((len(prompts), new), dtype=torch.bool)
    positions = torch.ones((len(prompts), new), dtype=torch.long)  # padding: 1, masked anyway (as HF generate)
    first_column = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
    for row, (prompt, hit) in enumerate(zip(prompts, hits, strict=True)):
        suffix = len(prompt) - hit.tokens
        input_ids[row, new - suffix :] = torch.as_tensor(prompt[hit.tokens :], dtype=torch.long)
        real[row, new - suffix :] = True
        positions[row, new - suffix :] = torch.arange(hit.tokens, len(prompt))
    return input_ids.to(device), real.to(device), positions.to(device), first_column.to(device)


def _chunk_mask(first_column: torch.Tensor, width: int, new: int, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [rows, 1, end - start, width - new + end] for input columns [start, end): a query sees
    its row's columns from the row's first (its prefix) up to its own; a padding query (left of the row's
    first real column) its row's first key only, a real prefix key, so no row of the mask is empty."""
    own = torch.arange(start, end, device=first_column.device) + (width - new)  # [queries] buffer columns
    columns = torch.arange(width - new + end, device=first_column.device)  # [keys]
    last = torch.maximum(own[None, :], first_column[:, None])  # [rows, queries]
    allowed = (columns[None, None, :] >= first_column[:, None, None]) & (columns[None, None, :] <= last[:, :, None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=first_column.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


@without_autograd
def prefill_continued(
    model: torch.nn.Module,
    spec: ForwardSpec,
    hits: Sequence[PrefixHit],
    prompts: Sequence[Sequence[int]],
    pad_token_id: int,
    chunk_tokens: int | None,
) -> PrefillOutput:
    """K/V of the whole prompts, right-aligned `[rows, kv_heads, longest, head_dim]` per layer, and the
    last logits; only the suffixes after each `hits[b].tokens` cached tokens run through the model."""
    device = next(model.parameters()).device
    input_ids, real, positions, first_column = _layout(hits, prompts, pad_token_id, device)
    keys, values = _buffers(hits, prompts)
    cache = _ContinuationCache(keys, values, real)
    width, new = keys[0].shape[2], input_ids.shape[1]
    step = new if chunk_tokens is None else max(1, chunk_tokens // len(prompts))
    kwargs = {"logits_to_keep": 1} if spec.accepts_logits_to_keep else {}
    output, forwards = None, 0
    for start in range(0, new, step):
        end = min(start + step, new)
        cache.chunk(start, end)
        output = model(
            input_ids=input_ids[:, start:end],
            attention_mask=_chunk_mask(first_column, width, new, start, end, keys[0].dtype),
            position_ids=positions[:, start:end],
            use_cache=True,
            **{spec.cache_keyword: cache},
            **kwargs,
        )
        forwards += 1
    return PrefillOutput(keys, values, output.logits[:, -1, :].float(), forwards=forwards, tokens=len(prompts) * new)
