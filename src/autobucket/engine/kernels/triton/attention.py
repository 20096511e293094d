"""The batch-invariant attention over the static cache, one kernel for every form a forward takes: decode
(one query over the cache, rows right-aligned with gaps), packed and one-shot prefill, chunked prefill over
a cached prefix, sliding windows.

Each program is one (row, head, tile of ATTENTION_BLOCK_Q queries of that row). Each query walks its own
allowed keys, in their column order, in blocks of ATTENTION_BLOCK_N counted from its first allowed key (`key_order`: the allowed columns first,
gathered; the kernel reads no other column), with an online softmax in fp32. The reduction order is thus
a function of the query's key sequence alone: the same bits in a decode step, a chunk, a padded batch or
a trainer's teacher-forced forward. A window is the mask's: the kernel sees only the keys the mask allows,
so a windowed query's blocks count from the window's first key, as the CPU kernel's do. Lanes past a
query's last key are -inf and contribute exact zeros, so the blocks a tile walks for its longer queries
leave a shorter one's values exactly as they were; a query with no key gives zeros. Grouped-query
heads read their K/V head in place."""

from __future__ import annotations

import threading
import weakref

import torch
import triton
import triton.language as tl

from autobucket.engine.kernels.triton.tiles import ATTENTION_BLOCK_N, ATTENTION_BLOCK_Q


@triton.jit
def attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, order_ptr, count_ptr, heads, group, queries, head_dim, scale,
    sq_r, sq_h, sq_q, sk_r, sk_h, sk_c, sv_r, sv_h, sv_c, so_r, so_q, so_h, sord_r, sord_q, sc_r, sc_q,
    GATHER: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0) // heads
    head = tl.program_id(0) % heads
    query = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BLOCK_Q] this tile's queries of the row
    in_call = query < queries
    kv_head = head // group
    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < head_dim
    q_at = q_ptr + row * sq_r + head * sq_h + query[:, None] * sq_q + dims[None, :]
    q = tl.load(q_at, mask=in_call[:, None] & in_dim[None, :], other=0.0).to(tl.float32)  # [BLOCK_Q, BLOCK_D]
    count = tl.load(count_ptr + row * sc_r + query * sc_q, mask=in_call, other=0)  # [BLOCK_Q] allowed keys
    k_base = k_ptr + row * sk_r + kv_head * sk_h
    v_base = v_ptr + row * sv_r + kv_head * sv_h
    best = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    longest = tl.max(count, axis=0)
    start = 0
    while start < longest:  # a `while`: triton 3.6's interpreter breaks `range` over runtime ints
        index = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions in each query's own key sequence
        live = index[None, :] < count[:, None]  # [BLOCK_Q, BLOCK_N]
        if GATHER:
            order_at = order_ptr + row * sord_r + query[:, None] * sord_q + index[None, :]
            column = tl.load(order_at, mask=live, other=0)
        else:  # causal / unmasked: the key sequence is the columns from 0
            column = index[None, :] + tl.zeros((BLOCK_Q, BLOCK_N), tl.int32)
        both = live[:, :, None] & in_dim[None, None, :]
        k = tl.load(k_base + column[:, :, None] * sk_c + dims[None, None, :], mask=both, other=0.0).to(tl.float32)
        scores = tl.where(live, tl.sum(k * q[:, None, :], axis=2) * scale, float("-inf"))  # [BLOCK_Q, BLOCK_N]
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        # a block with no key of a query leaves it exactly as it was (rescale exp(0) = 1, weights 0); before
        # its first key a query's sums are zeros whatever the rescale
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        rescale = tl.exp(best - shift)
        weights = tl.where(live, tl.exp(scores - shift[:, None]), 0.0)
        v = tl.load(v_base + column[:, :, None] * sv_c + dims[None, None, :], mask=both, other=0.0).to(tl.float32)
        total = total * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v, axis=1)
        best = new_best
        start += BLOCK_N
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # no key: zeros
    out_at = out_ptr + row * so_r + query[:, None] * so_q + head * so_h + dims[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=in_call[:, None] & in_dim[None, :])


class _OrderMemo(threading.local):
    """One forward hands every layer the same mask: its key order is kept for the next layer."""

    mask: weakref.ref | None = None
    columns: int = -1
    answer: tuple[torch.Tensor, torch.Tensor] | None = None


_MEMO = _OrderMemo()


def key_order(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """allowed bool [rows, queries | 1, columns] -> (order int32 [rows, queries | 1, columns]: each query's
    allowed columns first, in column order; count int32 [rows, queries | 1]: how many)."""
    order = torch.sort((~allowed).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    return order.contiguous(), allowed.sum(-1, dtype=torch.int32).contiguous()


def memoized_key_order(allowed: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`key_order(allowed)`, kept per thread for the mask object `source` it came from."""
    memo = _MEMO
    if memo.mask is not None and memo.mask() is source and memo.columns == allowed.shape[-1] and memo.answer:
        return memo.answer
    answer = key_order(allowed)
    memo.mask, memo.columns, memo.answer = weakref.ref(source), allowed.shape[-1], answer
    return answer


def causal_counts(rows: int, queries: int, columns: int, causal: bool, device: torch.device) -> torch.Tensor:
    """int32 [rows, queries]: a causal query i sees columns - queries + i + 1 keys from column 0; else all."""
    if not causal:
        return torch.full((rows, queries), columns, dtype=torch.int32, device=device)
    counts = torch.arange(columns - queries + 1, columns + 1, dtype=torch.int32, device=device).clamp(min=0)
    return counts.expand(rows, queries).contiguous()


def launch_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    order: torch.Tensor | None,
    count: torch.Tensor,
    scale: float,
    block_n: int = ATTENTION_BLOCK_N,
) -> torch.Tensor:
    """query [rows, heads, queries, D], key/value [rows, kv_heads, columns, D] (last dim contiguous),
    order [rows, queries | 1, columns] int32 or None (keys from column 0), count [rows, queries | 1] int32
    -> [rows, queries, heads, D] in query's dtype. `block_n` is the tests' handle."""
    rows, heads, queries, head_dim = query.shape
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = torch.empty((rows, queries, heads, head_dim), dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    gather = order is not None
    order_arg = order if gather else count
    order_strides = (order.stride(0), order.stride(1) if order.shape[1] > 1 else 0) if gather else (0, 0)
    count_strides = (count.stride(0), count.stride(1) if count.shape[1] > 1 else 0)
    grid = (rows * heads, triton.cdiv(queries, ATTENTION_BLOCK_Q))
    attention_kernel[grid](
        query, key, value, out, order_arg, count, heads, heads // key.shape[1], queries, head_dim, float(scale),
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), out.stride(0), out.stride(1), out.stride(2),
        *order_strides, *count_strides,
        GATHER=gather, BLOCK_Q=ATTENTION_BLOCK_Q, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out


@torch.library.custom_op("autobucket_triton::attention", mutates_args=())
def invariant_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    order: torch.Tensor | None,
    count: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`launch_attention` as one op (CUDA graphs and torch.compile capture it whole)."""
    return launch_attention(query, key, value, order, count, scale)


@invariant_attention.register_fake
def _(query, key, value, order, count, scale):
    rows, heads, queries, head_dim = query.shape
    return query.new_empty((rows, queries, heads, head_dim))
