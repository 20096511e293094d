"""Chunked prefill: a prompt longer than the per-forward token budget, in forwards of at most
`chunk_tokens` tokens each, every chunk attending to the K/V its earlier chunks left in the cache.

This is the model's own incremental path (the one decode uses, with many query tokens): the chunk's
`input_ids [1, c]`, an all-ones 2-D mask over prefix + chunk, position ids start..start+c-1, and the
cache the previous chunk returned. Peak activation memory is that of a `chunk_tokens` forward (plus
the growing K/V itself), not of the whole prompt; attention work is still L^2 over the chunks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autobucket.engine.batching.prefill import PrefillOutput
from autobucket.engine.intercept.grad_mode import without_autograd
from autobucket.engine.model_access.hf_compat import (
    ForwardSpec,
    full_prefill_cache,
    layer_key_values,
    output_cache,
)


def _chunk_mask(start: int, end: int, device: torch.device) -> torch.Tensor:
    """2-D mask `[1, end]` of the chunk [start, end): it sees its whole cached prefix."""
    return torch.ones((1, end), dtype=torch.long, device=device)


@without_autograd
def prefill_chunked(
    model: torch.nn.Module, spec: ForwardSpec, prompt: Sequence[int], chunk_tokens: int
) -> PrefillOutput:
    """K/V `[1, kv_heads, L, head_dim]` per layer and the last token's logits of one prompt."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(list(prompt), dtype=torch.long, device=device)
    length, cache, output, forwards = len(prompt), None, None, 0
    kwargs = {"logits_to_keep": 1} if spec.accepts_logits_to_keep else {}
    kwargs.update(full_prefill_cache(model, spec))
    for start in range(0, length, chunk_tokens):
        end = min(start + chunk_tokens, length)
        if cache is not None:
            kwargs[spec.cache_keyword] = cache
        output = model(
            input_ids=ids[None, start:end],
            attention_mask=_chunk_mask(start, end, device),
            position_ids=torch.arange(start, end, device=device)[None],
            use_cache=True,
            **kwargs,
        )
        cache = output_cache(output)
        forwards += 1
    keys, values = layer_key_values(output_cache(output))
    logits = output.logits[:, -1, :].float()  # [1, vocab]
    return PrefillOutput(keys, values, logits, segments=[(0, 0, length)], forwards=forwards, tokens=length)
