"""Continued prefill: prompts whose first tokens' K/V came from the prefix cache prefill only the rest,
as queries attending to the cached prefix (the chunked prefill's path, with the prefix given).

One forward serves a group: the cached prefixes are right-aligned in a DynamicCache of `past` columns
(the longest prefix), the new tokens left-padded to the longest suffix after them, so row b reads

    [pad .. pad | prefix_b] [pad .. pad | suffix_b]
     <- past columns ->      <- new columns ->

with a 2-D attention mask that is 1 exactly on its prefix and suffix (the gap between them is masked)
and position ids `prefix_b + j` for the j-th suffix token, so each real token sees its true position
and exactly the keys before it, as in a one-shot prefill of the whole prompt. A suffix longer than the
token budget runs in column chunks, each attending to the cache the previous chunk left. The output
K/V is gathered back to each row's contiguous right-aligned form, as a padded prefill returns it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from autobucket.engine.batching.prefill import PrefillOutput
from autobucket.engine.batching.prefix_cache import PrefixHit
from autobucket.engine.model_access.grad_mode import without_autograd
from autobucket.engine.model_access.hf_compat import ForwardSpec, layer_key_values, output_cache


def _past_cache(hits: Sequence[PrefixHit], past: int) -> DynamicCache:
    """A DynamicCache of the prefixes right-aligned in `past` columns: per layer [rows, kv_heads, past, head_dim]."""
    cache = DynamicCache()
    for layer in range(len(hits[0].keys)):
        shape = (len(hits), *hits[0].keys[layer].shape)
        keys = hits[0].keys[layer].new_zeros(shape[:2] + (past,) + shape[3:])
        values = torch.zeros_like(keys)
        for row, hit in enumerate(hits):
            keys[row, :, past - hit.tokens :] = hit.keys[layer]
            values[row, :, past - hit.tokens :] = hit.values[layer]
        cache.update(keys, values, layer)
    return cache


def _layout(
    hits: Sequence[PrefixHit], prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [rows, new] (suffixes left-padded), attention mask [rows, past + new], position ids [rows, new]."""
    past = max(hit.tokens for hit in hits)
    new = max(len(p) - hit.tokens for p, hit in zip(prompts, hits, strict=True))
    input_ids = torch.full((len(prompts), new), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), past + new), dtype=torch.long)
    positions = torch.ones((len(prompts), new), dtype=torch.long)  # padding: 1, masked anyway (as HF generate)
    for row, (prompt, hit) in enumerate(zip(prompts, hits, strict=True)):
        suffix = len(prompt) - hit.tokens
        input_ids[row, new - suffix :] = torch.as_tensor(prompt[hit.tokens :], dtype=torch.long)
        mask[row, past - hit.tokens : past] = 1
        mask[row, past + new - suffix :] = 1
        positions[row, new - suffix :] = torch.arange(hit.tokens, len(prompt))
    return input_ids.to(device), mask.to(device), positions.to(device)


def _contiguous_index(
    hits: Sequence[PrefixHit], prompts: Sequence[Sequence[int]], past: int, new: int, device: torch.device
) -> torch.Tensor:
    """[rows, width] column of each row's real K/V in the forward's [past + new] columns, right-aligned
    to `width` = the longest prompt (padding columns read column 0: never attended)."""
    width = max(len(p) for p in prompts)
    index = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, (prompt, hit) in enumerate(zip(prompts, hits, strict=True)):
        suffix = len(prompt) - hit.tokens
        columns = list(range(past - hit.tokens, past)) + list(range(past + new - suffix, past + new))
        index[row, width - len(prompt) :] = torch.as_tensor(columns, dtype=torch.long)
    return index.to(device)


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
    input_ids, mask, positions = _layout(hits, prompts, pad_token_id, device)
    past, new = mask.shape[1] - input_ids.shape[1], input_ids.shape[1]
    cache = _past_cache(hits, past)
    step = new if chunk_tokens is None else max(1, chunk_tokens // len(prompts))
    kwargs = {"logits_to_keep": 1} if spec.accepts_logits_to_keep else {}
    output, forwards = None, 0
    for start in range(0, new, step):
        end = min(start + step, new)
        output = model(
            input_ids=input_ids[:, start:end],
            attention_mask=mask[:, : past + end],
            position_ids=positions[:, start:end],
            use_cache=True,
            **{spec.cache_keyword: cache},
            **kwargs,
        )
        cache, forwards = output_cache(output), forwards + 1
    keys, values = layer_key_values(cache)  # per layer [rows, kv_heads, past + new, head_dim]
    index = _contiguous_index(hits, prompts, past, new, device)
    rows, kv_heads, _, head_dim = keys[0].shape
    gather = index[:, None, :, None].expand(rows, kv_heads, index.shape[1], head_dim)
    keys = [k.gather(2, gather) for k in keys]
    values = [v.gather(2, gather) for v in values]
    return PrefillOutput(
        keys, values, output.logits[:, -1, :].float(), forwards=forwards, tokens=len(prompts) * new
    )
