"""The engine's one Llama-family decode step, written once over a `DecodeOps` record.

It calls the model's leaves (embedding, rotary embedding, RMSNorms, linears, rotary, gated MLP,
attention) in the order and with the shapes of the model's forward, skipping transformers' per-layer
orchestration (module calls, kwargs plumbing, output capture, mask preprocessing, the cache interface),
a share of a small model's step that grows as the kernels get faster. Which kernel runs each op is the
ops record's business (`ops.py`): the model's own modules, or the engine's kernels straight; the step is
the same either way, eager or compiled. Every value is bitwise what `model(...)` computes on the same
kernels (tested per architecture, dtype and kernel set)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autobucket.engine.decode.ops import AttentionOp, DecodeOps
from autobucket.engine.decode.parts import LlamaParts

KeyValueWrite = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def llama_decode_step(
    parts: LlamaParts,
    ops: DecodeOps,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    write: KeyValueWrite,
    shared_prefix: bool = False,
) -> torch.Tensor:
    """input_ids, position_ids [rows, 1]; `write(layer, key, value)` stores a layer's new K/V [rows,
    kv_heads, 1, head_dim] and returns the layer's K/V up to them; `shared_prefix`: rows read a shared
    prefix's K/V (`ops.shared_prefix_attention`). -> logits [rows, 1, vocab] in the model's dtype."""
    inner = parts.inner
    hidden = inner.embed_tokens(input_ids)  # [rows, 1, hidden]
    cos, sin = inner.rotary_emb(hidden, position_ids)
    attend = ops.shared_prefix_attention if shared_prefix else ops.attention
    for index, layer in enumerate(parts.layers):
        residual = hidden
        normed = ops.rms_norm(layer.input_layernorm, hidden)
        hidden = residual + _attention(parts, ops, attend, index, layer.self_attn, normed, cos, sin, write)
        residual = hidden
        hidden = residual + ops.gated_mlp(layer.mlp, ops.rms_norm(layer.post_attention_layernorm, hidden))
    hidden = ops.rms_norm(inner.norm, hidden)
    return ops.linear(parts.lm_head, hidden[:, 0:, :])  # the model slices `logits_to_keep=0` the same way


def _attention(
    parts: LlamaParts,
    ops: DecodeOps,
    attend: AttentionOp,
    index: int,
    attention: Any,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    write: KeyValueWrite,
) -> torch.Tensor:
    rows = hidden.shape[0]
    hidden_shape = (rows, 1, -1, attention.head_dim)  # [rows, 1, heads, head_dim]
    # The projections in the model's order (a fused group of linears learns its members from that order).
    query = ops.linear(attention.q_proj, hidden).view(hidden_shape)
    if parts.qk_norm:  # Qwen3: per-head RMSNorms before the rotary embedding
        query = ops.rms_norm(attention.q_norm, query)
    key = ops.linear(attention.k_proj, hidden).view(hidden_shape)
    if parts.qk_norm:
        key = ops.rms_norm(attention.k_norm, key)
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    value = ops.linear(attention.v_proj, hidden).view(hidden_shape).transpose(1, 2)
    query, key = ops.rotary(query, key, cos, sin)
    key, value = write(attention.layer_idx, key, value)
    output = attend(index, attention, query, key, value)  # [rows, 1, heads, head_dim]
    return ops.linear(attention.o_proj, output.reshape(rows, 1, -1).contiguous())
