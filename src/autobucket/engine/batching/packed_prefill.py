"""Packed prefill: several prompts concatenated in one row of one forward, no padding.

Each prompt keeps its own position ids (0..L-1, restarting at every prompt), so RoPE and learned
position embeddings see what a single-request prefill sees; attention must then be block-diagonal
causal: a token attends only to earlier tokens of its own prompt. Two ways to get that:

- `segments` (SDPA models): this forward's attention runs HF's own SDPA once per prompt on its slice of
  the row (no mask, `is_causal`), exactly the call a single-request prefill makes; it is selected for the
  engine's forward only (`engine/intercept/attention.py`), never by writing the model's config. Attention work is
  sum(L_i^2), as unpadded.
- `dense` (any implementation, the always-available fallback): a 4-D additive mask `[1, 1, T, T]`,
  block-diagonal causal, through the model's own attention. It costs T^2 attention work and T^2 mask
  memory, which the planner charges for.

The projections and MLP run once over all T tokens: one large GEMM instead of several small padded
ones. flex_attention was not used: on this CPU build the dense-mask SDPA and per-segment SDPA cover
both cases without a compile step (see docs/benchmarks.md).

The returned K/V is `[1, kv_heads, T, head_dim]` per layer; `PrefillOutput.segments` says which
columns belong to which prompt, and the runner copies each slice right-aligned into its cache row."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from autobucket.engine.batching.prefill import PrefillOutput
from autobucket.engine.intercept.active import active, forward_with
from autobucket.engine.intercept.attention import (
    base_attention,
    dispatches,
    engine_attention,
    placeholder_mask,
    windows_applied,
    within_window,
)
from autobucket.engine.intercept.grad_mode import without_autograd
from autobucket.engine.model_access.hf_compat import (
    ForwardSpec,
    full_prefill_cache,
    layer_key_values,
    output_cache,
)
from autobucket.planning.forms import DENSE, SEGMENTS


class _Packing:
    """The packed forward in progress: (start, end) columns of each prompt, and how many attention
    layers ran through `_segment_attention` (checked: a layer that kept its own attention would see
    the placeholder mask, i.e. no mask at all)."""

    def __init__(self, bounds: list[tuple[int, int]]) -> None:
        self.bounds, self.calls = bounds, 0


def _segment_attention(module, query, key, value, attention_mask, **kwargs):
    """query [1, heads, T, D], key/value [1, kv_heads, T, D] -> ([1, T, heads, D], None)."""
    sdpa = base_attention()  # transformers' SDPA, or the invariant kernel (kernels='invariant')
    packing = active().packing
    assert packing is not None, "segment attention runs only inside a packed prefill"
    packing.calls += 1
    # Some layers (GPT-2 on transformers 4.57) derive is_causal=False from the 4-D placeholder mask;
    # each segment is an unmasked causal self-attention, so let SDPA read causality off the module.
    kwargs.pop("is_causal", None)
    # A sliding layer of a call past its window: a segment longer than the window gets the causal
    # window as its mask (None otherwise: plain causal).
    window = kwargs.get("sliding_window") if windows_applied() else None
    outputs = [
        sdpa(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
             within_window(None, window, e - s, e - s, query.device) if window else None, **kwargs)[0]
        for s, e in packing.bounds
    ]
    return torch.cat(outputs, dim=1), None


def packing_attention(model: torch.nn.Module) -> str:
    """How packed prompts are kept apart for this model: per-segment SDPA, else a dense 4-D mask."""
    return SEGMENTS if dispatches(model) else DENSE


def bounds_of(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) columns of each prompt in the packed row."""
    bounds, start = [], 0
    for length in lengths:
        bounds.append((start, start + length))
        start += length
    return bounds


def block_causal_mask(lengths: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask `[1, 1, T, T]`: 0 where query i may see key j (same prompt, j <= i), dtype-min elsewhere."""
    prompt = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    column = torch.arange(prompt.shape[0], device=device)
    allowed = (prompt[:, None] == prompt[None, :]) & (column[:, None] >= column[None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@contextmanager
def _segments_selected(bounds: list[tuple[int, int]]) -> Iterator[_Packing]:
    """This thread's forwards in the block run `_segment_attention`; yields the `_Packing` whose `calls`
    count the layers that used it."""
    packing = _Packing(bounds)
    # on the thread's record, because HF's attention-function signature has no argument every
    # architecture passes on to the attention function
    with forward_with(packing=packing), engine_attention(_segment_attention):
        yield packing


def _check_every_layer_used_segments(model: torch.nn.Module, packing: _Packing, layers: int) -> None:
    if packing.calls != layers:
        raise RuntimeError(
            f"packed prefill: {packing.calls} of {layers} attention layers of {type(model).__name__} used "
            "per-prompt attention (the others read the attention implementation elsewhere); load the model "
            "with attn_implementation='eager' (dense-mask packing) or pass RolloutConfig(packing=False)"
        )


@without_autograd
def prefill_packed(
    model: torch.nn.Module, spec: ForwardSpec, prompts: Sequence[Sequence[int]], attention: str
) -> PrefillOutput:
    """One forward of all `prompts` concatenated in one row; K/V `[1, kv_heads, T, D]` with segments."""
    device = next(model.parameters()).device
    lengths = [len(p) for p in prompts]
    bounds = bounds_of(lengths)
    total = bounds[-1][1]
    input_ids = torch.tensor([[t for p in prompts for t in p]], dtype=torch.long, device=device)  # [1, T]
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])[None]  # [1, T]
    last = torch.tensor([e - 1 for _, e in bounds], dtype=torch.long, device=device)
    kwargs = {"logits_to_keep": last} if spec.accepts_logits_to_keep else {}
    kwargs.update(full_prefill_cache(model, spec))
    dtype = next(model.parameters()).dtype
    if attention == SEGMENTS:
        # A zero-cost 4-D placeholder: mask construction returns a 4-D mask as is, and the segment
        # attention ignores it (its blocks are the bounds).
        mask = placeholder_mask(torch.zeros((1, 1, 1, 1), dtype=dtype, device=device).expand(1, 1, total, total))
        with _segments_selected(bounds) as packing:
            output = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **kwargs)
        _check_every_layer_used_segments(model, packing, len(layer_key_values(output_cache(output))[0]))
    else:
        mask = block_causal_mask(lengths, dtype, device)
        output = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **kwargs)
    logits = output.logits[0] if spec.accepts_logits_to_keep else output.logits[0, last]  # [prompts, vocab]
    keys, values = layer_key_values(output_cache(output))
    segments = [(0, s, e) for s, e in bounds]
    return PrefillOutput(keys, values, logits.float(), segments=segments, forwards=1, tokens=total)
