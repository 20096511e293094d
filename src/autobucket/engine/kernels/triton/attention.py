"""The batch-invariant attention over the static cache, one kernel for every form a forward takes: decode
(one query over the cache, rows right-aligned with gaps), packed and one-shot prefill, chunked prefill over
a cached prefix, sliding windows.

Each program is one (row, head, query). It walks the query's own allowed keys, in their column order,
in blocks of ATTENTION_BLOCK_N counted from its first allowed key (`key_order`: the allowed columns first,
gathered; the kernel reads no other column), with an online softmax in fp32. The reduction order is thus
a function of the query's key sequence alone: the same bits in a decode step, a chunk, a padded batch or
a trainer's teacher-forced forward. A window is the mask's: the kernel sees only the keys the mask allows,
so a windowed query's blocks count from the window's first key, as the CPU kernel's do. Lanes past the
query's last key are -inf and contribute exact zeros; a query with no key gives zeros. Grouped-query
heads read their K/V head in place."""

from __future__ import annotations

import threading
import weakref

import torch
import triton
import triton.language as tl

from autobucket.engine.kernels.triton.tiles import ATTENTION_BLOCK_N


@triton.jit
def attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, order_ptr, count_ptr, heads, group, head_dim, scale,
    sq_r, sq_h, sq_q, sk_r, sk_h, sk_c, sv_r, sv_h, sv_c, so_r, so_q, so_h, sord_r, sord_q, sc_r, sc_q,
    GATHER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0) // heads
    head = tl.program_id(0) % heads
    query = tl.program_id(1)
    kv_head = head // group
    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < head_dim
    q = tl.load(q_ptr + row * sq_r + head * sq_h + query * sq_q + dims, mask=in_dim, other=0.0).to(tl.float32)
    count = tl.load(count_ptr + row * sc_r + query * sc_q)  # the query's allowed keys
    k_base = k_ptr + row * sk_r + kv_head * sk_h
    v_base = v_ptr + row * sv_r + kv_head * sv_h
    best = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    start = 0
    while start < count:  # a `while`: triton 3.6's interpreter breaks `range` over runtime ints
        index = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions in the query's key sequence
        live = index < count
        if GATHER:
            column = tl.load(order_ptr + row * sord_r + query * sord_q + index, mask=live, other=0)
        else:  # causal / unmasked: the key sequence is the columns from 0
            column = index
        both = live[:, None] & in_dim[None, :]
        k = tl.load(k_base + column[:, None] * sk_c + dims[None, :], mask=both, other=0.0).to(tl.float32)
        scores = tl.where(live, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))  # [BLOCK_N]
        new_best = tl.maximum(best, tl.max(scores, axis=0))
        rescale = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best)
        v = tl.load(v_base + column[:, None] * sv_c + dims[None, :], mask=both, other=0.0).to(tl.float32)
        total = total * rescale + tl.sum(weights, axis=0)
        acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
        best = new_best
        start += BLOCK_N
    out = tl.where(total > 0, acc / total, 0.0)
    tl.store(out_ptr + row * so_r + query * so_q + head * so_h + dims, out.to(out_ptr.dtype.element_ty), mask=in_dim)


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
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, order: torch.Tensor | None, count: torch.Tensor,
    scale: float, block_n: int = ATTENTION_BLOCK_N,
) -> torch.Tensor:  # fmt: skip
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
    attention_kernel[(rows * heads, queries)](
        query, key, value, out, order_arg, count, heads, heads // key.shape[1], head_dim, float(scale),
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), out.stride(0), out.stride(1), out.stride(2),
        *order_strides, *count_strides,
        GATHER=gather, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out


@torch.library.custom_op("autobucket_triton::attention", mutates_args=())
def invariant_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, order: torch.Tensor | None, count: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """`launch_attention` as one op (CUDA graphs and torch.compile capture it whole)."""
    return launch_attention(query, key, value, order, count, scale)


@invariant_attention.register_fake
def _(query, key, value, order, count, scale):
    rows, heads, queries, head_dim = query.shape
    return query.new_empty((rows, queries, heads, head_dim))
