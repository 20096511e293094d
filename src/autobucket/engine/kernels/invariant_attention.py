"""Batch-invariant attention: the engine's own kernel for every attention call of `kernels="invariant"`.

transformers' SDPA picks its reduction order by shape: the flash kernel splits keys into blocks counted
from column 0 of whatever tensor it is given, the math path runs a GEMM whose blocking depends on how
many queries and columns there are. So a token's attention output differs by the last bits between
decode (one query over the static cache, right-aligned, with gaps), chunked prefill, a padded batch and
a trainer's teacher-forced forward. The kernel here (`csrc/invariant_attention.cpp`) walks each query's
own allowed keys in blocks counted from its first allowed key, so its result depends on the sequence
alone: bitwise the same on every route, batch, padding and refill order. It reads only the keys a row
may see (masked columns are skipped, not read), and grouped-query heads share one read of their K/V.

It is part of the engine's C++ kernel library (`library.py`), compiled for the machine at first use.

`invariant_sdpa` has transformers' attention-function signature; the engine selects it per thread
(`engine/intercept/attention.py`), so no model config is written."""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Any

import torch

from autobucket.engine.intercept.attention import hf_sdpa
from autobucket.engine.intercept.functions import dropout_suppressed
from autobucket.engine.kernels.library import load_invariant_kernels
from autobucket.engine.model_access.weight_versions import in_place_version


class _AllowedMemo(threading.local):
    """One forward builds its attention mask once and hands the same tensor to every layer, so the
    bool form of the last mask seen on this thread is kept (keyed on the object and its version)."""

    mask: weakref.ref | None = None
    version: int | None = None
    columns: int = -1
    allowed: torch.Tensor | None = None


_MEMO = _AllowedMemo()
_EMPTY = torch.empty(0, dtype=torch.bool)


def allowed_keys(mask: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """A 4-D attention mask `[rows | 1, 1, queries | 1, >= columns]` (bool: True = attend; additive:
    0 = attend, dtype-min = masked) -> contiguous bool `[rows, queries | 1, columns]`."""
    allowed = _allowed_or_none(mask, rows, columns)
    if allowed is not None:
        return allowed
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(
            f"invariant attention takes a [rows, 1, queries, columns] mask shared by all heads, got shape "
            f"{tuple(mask.shape)}; use RolloutConfig(kernels='torch') for per-head masks"
        )
    raise ValueError(
        "invariant attention takes a boolean or 0 / -inf additive mask, got an additive bias (ALiBi-"
        "style); use RolloutConfig(kernels='torch') for this model"
    )


def _allowed_or_none(mask: torch.Tensor, rows: int, columns: int) -> torch.Tensor | None:
    """`allowed_keys`, or None for a mask the kernel cannot take (per head, an additive bias); the last
    answer per thread is kept (one forward hands every layer the same mask)."""
    memo, given = _MEMO, mask
    if memo.mask is not None and memo.mask() is given and memo.version == _version(given) and memo.columns == columns:
        return memo.allowed
    allowed: torch.Tensor | None = None
    if mask.dim() == 4 and mask.shape[1] == 1:
        mask = mask[:, 0, :, :columns]
        if mask.dtype == torch.bool:
            allowed = mask
        else:
            allowed = mask == 0
            masked_floor = torch.finfo(mask.dtype).min / 2
            if not bool((allowed | (mask <= masked_floor)).all()):
                allowed = None
        if allowed is not None:
            allowed = allowed.expand(rows, -1, -1).contiguous()
    memo.mask, memo.version, memo.columns, memo.allowed = weakref.ref(given), _version(given), columns, allowed
    return allowed


# Inference tensors keep no version counter (None); every caller builds a new mask object per forward
# (the static cache hands out a new view per step), so identity alone is the key there.
_version = in_place_version


def allowed_for(attention_mask: torch.Tensor | None, rows: int, columns: int) -> torch.Tensor:
    """The kernel's `allowed` argument for a forward's mask: `allowed_keys`, or an empty tensor for no mask."""
    return _EMPTY if attention_mask is None else allowed_keys(attention_mask, rows, columns)


def invariant_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """query [rows, heads, queries, D], key/value [rows, kv_heads, columns, D] -> [rows, queries, heads, D].

    attention_mask: 4-D (bool or 0/-inf additive) or None (causal: query i sees the first
    columns - queries + i + 1 keys; not causal: all)."""
    load_invariant_kernels()
    allowed = allowed_for(attention_mask, query.shape[0], key.shape[2])
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return _InvariantAttention.apply(query, key, value, allowed, causal, float(scale))
    return torch.ops.autobucket.invariant_attention(query, key, value, allowed, causal, float(scale))


def invariant_attention_shared(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    shared_key: torch.Tensor,
    shared_value: torch.Tensor,
    shared_length: torch.Tensor,
    row_group: torch.Tensor,
    shared_tiles: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """`invariant_attention` of decode queries whose rows first read a shared prompt's keys (cascade
    decode): row r of group g = row_group[r] >= 0 sees shared_key[g, :, :shared_length[g]] and then its
    own allowed columns, in the same blocks and order as one sequence, so its output is bitwise that of
    a row holding the whole prompt itself. shared_key, shared_value [groups, kv_heads, shared, D];
    shared_tiles: `shared_prefix_tiles` of them, kept across a call's steps (None: made in each call).
    window > 0: a sliding layer's window (attention_mask already narrowed to it): a row reads only the
    shared keys its window still covers, the window's newest keys of [shared | own] as one sequence."""
    load_invariant_kernels()
    rows, columns = query.shape[0], key.shape[2]
    allowed = _EMPTY if attention_mask is None else allowed_keys(attention_mask, rows, columns)
    return torch.ops.autobucket.invariant_attention_shared(
        query, key, value, allowed, float(scale), shared_key, shared_value, shared_length, row_group, shared_tiles,
        int(window),
    )


def shared_prefix_tiles(shared_key: torch.Tensor, shared_value: torch.Tensor, shared_length: torch.Tensor) -> torch.Tensor:
    """The invariant kernel's tiles of a cascade's shared keys ([groups, kv_heads, shared * D] fp32; bf16 keys:
    2 * shared * D, their values widened after the tiles; empty where the build reads none), made once for
    the steps that read them."""
    load_invariant_kernels()
    return torch.ops.autobucket.shared_prefix_tiles(shared_key, shared_value, shared_length)


class _InvariantAttention(torch.autograd.Function):
    """Forward values from the invariant kernel; gradients from SDPA recomputed on the saved inputs
    (the backward needs no invariance, only the right gradient)."""

    @staticmethod
    def forward(ctx, query, key, value, allowed, causal, scale):  # type: ignore[override]
        ctx.save_for_backward(query, key, value, allowed)
        ctx.causal, ctx.scale = causal, scale
        return torch.ops.autobucket.invariant_attention(query, key, value, allowed, causal, scale)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        query, key, value, allowed = ctx.saved_tensors
        wants = ctx.needs_input_grad[:3]
        inputs = [t.detach().requires_grad_(need) for t, need in zip((query, key, value), wants, strict=True)]
        with torch.enable_grad():
            output = reference_attention(*inputs, allowed, ctx.causal, ctx.scale)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(output, wanted, grad_output))
        return *(next(grads) if t.requires_grad else None for t in inputs), None, None, None


def reference_attention(query, key, value, allowed: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """The same attention by SDPA (differentiable; not invariant): [rows, queries, heads, D]. Queries with
    no allowed key give zeros, as the kernel does."""
    rows, queries, columns = query.shape[0], query.shape[2], key.shape[2]
    if allowed.numel() == 0:
        allowed = torch.ones((queries, columns), dtype=torch.bool, device=query.device)
        if causal:
            allowed = allowed.tril(columns - queries)
        allowed = allowed.expand(rows, queries, columns)
    mask = allowed.expand(rows, queries, columns)
    has_keys = mask.any(-1)  # [rows, queries]
    mask = mask | ~has_keys[..., None]  # SDPA gives NaN on a fully masked query: unmask it, zero it below
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )  # [rows, heads, queries, D]
    return (output * has_keys[:, None, :, None].to(output.dtype)).transpose(1, 2)


def invariant_sdpa(module: Any, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                   is_causal=None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface over `invariant_attention`. Dropout is never applied:
    the engine's forwards run with eval semantics; a trainer's forward in train mode with attention
    dropout is refused (dropout would make its logits random, never the rollout's)."""
    scale, causal = attention_call(module, query, attention_mask, dropout, scaling, is_causal, kwargs)
    return invariant_attention(query, key, value, attention_mask, scale, causal), None


def attention_call(module: Any, query, attention_mask, dropout: float, scaling, is_causal, kwargs: dict) -> tuple[float, bool]:
    """(scale, causal) of a transformers attention call an invariant kernel set runs, or the ValueError
    naming what no invariant kernel can take (dropout in train mode, softcapping, sinks)."""
    if dropout and not dropout_suppressed():
        raise ValueError(
            f"invariant attention got attention dropout {dropout} ({type(module).__name__} in train mode): "
            "the trainer's logits cannot equal the rollout's under dropout; set the model's attention_dropout "
            "to 0 (TRL: disable_dropout=True) or call model.eval()"
        )
    for unsupported in _UNSUPPORTED_KWARGS:
        if kwargs.get(unsupported) is not None:
            raise ValueError(
                f"invariant attention has no {unsupported!r} (this architecture's attention, "
                f"{type(module).__name__}, uses it); use RolloutConfig(kernels='torch') for this model"
            )
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return scale, bool(is_causal) and attention_mask is None


_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")


def kernel_takes(query, key, attention_mask, dropout: float, kwargs: dict) -> bool:
    """Whether the kernel can take this decode attention call (one query per row, on a CPU, a mask
    shared by the heads with no additive bias, no softcapping or sinks, at most 16 query heads per K/V
    head, fp32 or bf16)."""
    return (
        query.device.type == "cpu" and query.shape[2] == 1 and not dropout
        and all(kwargs.get(name) is None for name in _UNSUPPORTED_KWARGS)
        and query.dtype in (torch.float32, torch.bfloat16)
        and query.shape[1] % key.shape[1] == 0 and query.shape[1] // key.shape[1] <= 16
        and (attention_mask is None or _allowed_or_none(attention_mask, query.shape[0], key.shape[2]) is not None)
    )


def decode_sdpa(module: Any, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                is_causal=None, **kwargs) -> tuple[torch.Tensor, None]:
    """The engine's decode attention (`decode_attention` on the `cpu` backend) over the static cache: the engine's kernel,
    which reads only each row's own keys (SDPA's flash kernel reads every column of the longest row for
    every row, masked or not), where it can take the call; transformers' SDPA for the rest (a per-head
    mask or an additive bias, softcapping or sinks, a GPU tensor). One query per row: no causal mask."""
    if not kernel_takes(query, key, attention_mask, dropout, kwargs):
        return hf_sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return invariant_attention(query, key, value, attention_mask, scale, False), None


@functools.cache
def decode_kernel_builds() -> bool:
    """Whether the engine's attention kernel is available for the default kernels' decode steps: it is
    built at first use (g++ and ninja); without them decode runs transformers' SDPA (warned once)."""
    try:
        load_invariant_kernels()
    except ValueError as error:
        warnings.warn(f"autobucket: decode attention runs transformers' SDPA: {error}", RuntimeWarning, stacklevel=2)
        return False
    return True
