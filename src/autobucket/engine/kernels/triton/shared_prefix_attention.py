"""Decode attention where rows read a shared prefix's one copy of K/V and then their own columns (a prompt's
n samples share the prompt; an admission's prompts share a system prompt), bitwise the per-row
`attention.py` kernel over the row's full sequence.

Each row walks one key sequence, [the prefix's keys it reads | its own allowed columns in column order], in
blocks of ATTENTION_BLOCK_N counted from that sequence's first key, with the per-row kernel's program shape
(one (row, head, tile of ATTENTION_BLOCK_Q queries)) and its block step op for op: a key at walk position i
meets the same neighbours in the same block as it does in a row holding the whole prompt itself, so the
online softmax takes the same steps. A block that straddles the prefix's end takes its first keys from the
shared copy and the rest from the row's own columns. A row with no prefix (`row_prefix` -1) is the per-row
kernel. Under a sliding window (`window` > 0; the own keys' order already narrowed to it) a row reads only
the prefix's keys its window still covers, the newest (window - own) of them, and its blocks count from
the first of those: the window's first key, as the per-row kernel's do."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autobucket.engine.kernels.triton.attention import causal_counts, memoized_key_order
from autobucket.engine.kernels.triton.tiles import ATTENTION_BLOCK_N, ATTENTION_BLOCK_Q

# Where the walk places each part (tests' handle; only "sequence" is the kernel's contract):
#   sequence  prefix keys read at positions 0.., own keys right after them (the row's own sequence)
#   copy      positions counted from the shared copy's column 0 (keys before a window's first are skipped)
#   split     own keys' blocks restart at the first own key (a walk of the prefix, then one of the row)
WALKS = {"sequence": 0, "copy": 1, "split": 2}


@triton.jit
def shared_prefix_attention_kernel(
    q_ptr, k_ptr, v_ptr, sk_ptr, sv_ptr, out_ptr, order_ptr, count_ptr, prefix_ptr, length_ptr,
    heads, heads_per_kv, queries, head_dim, scale, window,
    sq_r, sq_h, sq_q, sk_r, sk_h, sk_c, sv_r, sv_h, sv_c, ssk_p, ssk_h, ssk_c, ssv_p, ssv_h, ssv_c,
    so_r, so_q, so_h, sord_r, sord_q, sc_r, sc_q,
    GATHER: tl.constexpr, WALK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0) // heads
    head = tl.program_id(0) % heads
    query = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BLOCK_Q] this tile's queries of the row
    in_call = query < queries
    kv_head = head // heads_per_kv
    dims = tl.arange(0, BLOCK_D)
    in_dim = dims < head_dim
    q_at = q_ptr + row * sq_r + head * sq_h + query[:, None] * sq_q + dims[None, :]
    q = tl.load(q_at, mask=in_call[:, None] & in_dim[None, :], other=0.0).to(tl.float32)  # [BLOCK_Q, BLOCK_D]
    count = tl.load(count_ptr + row * sc_r + query * sc_q, mask=in_call, other=0)  # [BLOCK_Q] own allowed keys
    prefix = tl.load(prefix_ptr + row)
    has_prefix = prefix >= 0
    prefix = tl.maximum(prefix, 0)
    length = tl.load(length_ptr + prefix, mask=has_prefix, other=0)  # the prefix's keys (0: no prefix)
    # [BLOCK_Q] prefix keys each query reads: all, or under a window the newest (window - own) of them
    windowed = tl.minimum(tl.maximum(window - count, 0), length)
    taken = tl.where(in_call, tl.where(window > 0, windowed, length), 0)
    first_shared = length - taken  # [BLOCK_Q] the copy's column of the first prefix key read
    if WALK == 1:  # control: positions counted from the copy's column 0
        shared_at = first_shared
        own_at = length + tl.zeros((BLOCK_Q,), tl.int32)
    elif WALK == 2:  # control: the own keys' blocks restart at the first own key
        shared_at = tl.zeros((BLOCK_Q,), tl.int32)
        own_at = (taken + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    else:
        shared_at = tl.zeros((BLOCK_Q,), tl.int32)
        own_at = taken
    total = own_at + count  # [BLOCK_Q] walk positions up to each query's last key
    k_base = k_ptr + row * sk_r + kv_head * sk_h
    v_base = v_ptr + row * sv_r + kv_head * sv_h
    sk_base = sk_ptr + prefix * ssk_p + kv_head * ssk_h
    sv_base = sv_ptr + prefix * ssv_p + kv_head * ssv_h
    best = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    total_weight = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    longest = tl.max(total, axis=0)
    start = 0
    while start < longest:  # a `while`: triton 3.6's interpreter breaks `range` over runtime ints
        index = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] walk positions
        walk = index[None, :] + tl.zeros((BLOCK_Q, BLOCK_N), tl.int32)  # [BLOCK_Q, BLOCK_N]
        in_shared = (walk >= shared_at[:, None]) & (walk < (shared_at + taken)[:, None])
        in_own = (walk >= own_at[:, None]) & (walk < total[:, None])
        live = in_shared | in_own
        shared_column = first_shared[:, None] + walk - shared_at[:, None]
        own_index = walk - own_at[:, None]
        if GATHER:
            order_at = order_ptr + row * sord_r + query[:, None] * sord_q + own_index
            own_column = tl.load(order_at, mask=in_own, other=0)
        else:  # causal / unmasked: the own keys are the columns from 0
            own_column = own_index
        shared_dims = in_shared[:, :, None] & in_dim[None, None, :]
        own_dims = in_own[:, :, None] & in_dim[None, None, :]
        # masked lanes load exact zeros, as the per-row kernel's do; `where` keeps each key's bits as stored
        k_shared = tl.load(
            sk_base + shared_column[:, :, None] * ssk_c + dims[None, None, :], mask=shared_dims, other=0.0
        )
        k_own = tl.load(k_base + own_column[:, :, None] * sk_c + dims[None, None, :], mask=own_dims, other=0.0)
        k = tl.where(in_shared[:, :, None], k_shared.to(tl.float32), k_own.to(tl.float32))
        # from here on the per-row kernel's block step, op for op
        scores = tl.where(live, tl.sum(k * q[:, None, :], axis=2) * scale, float("-inf"))  # [BLOCK_Q, BLOCK_N]
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        rescale = tl.exp(best - shift)
        weights = tl.where(live, tl.exp(scores - shift[:, None]), 0.0)
        v_shared = tl.load(
            sv_base + shared_column[:, :, None] * ssv_c + dims[None, None, :], mask=shared_dims, other=0.0
        )
        v_own = tl.load(v_base + own_column[:, :, None] * sv_c + dims[None, None, :], mask=own_dims, other=0.0)
        v = tl.where(in_shared[:, :, None], v_shared.to(tl.float32), v_own.to(tl.float32))
        total_weight = total_weight * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v, axis=1)
        best = new_best
        start += BLOCK_N
    out = acc / tl.where(total_weight > 0, total_weight, 1.0)[:, None]  # no key: zeros
    out_at = out_ptr + row * so_r + query[:, None] * so_q + head * so_h + dims[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=in_call[:, None] & in_dim[None, :])


def launch_shared_prefix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    order: torch.Tensor | None,
    count: torch.Tensor,
    shared_key: torch.Tensor,
    shared_value: torch.Tensor,
    shared_length: torch.Tensor,
    row_prefix: torch.Tensor,
    window: int,
    scale: float,
    block_n: int = ATTENTION_BLOCK_N,
    walk: str = "sequence",
) -> torch.Tensor:
    """query [rows, heads, queries, D]; key/value [rows, kv_heads, columns, D], each row's own columns;
    order [rows, queries | 1, columns] int32 (each query's allowed own columns first, `attention.key_order`)
    or None (own keys from column 0); count [rows, queries | 1] int32 (how many); shared_key/shared_value
    [prefixes, kv_heads, longest, D], each prefix's K/V left-aligned; shared_length [prefixes] (its keys);
    row_prefix [rows] (each row's prefix, -1: none); window 0 or a sliding window -> [rows, queries, heads,
    D] in query's dtype. `block_n` and `walk` are the tests' handles."""
    _check(query, key, value, shared_key, shared_value, shared_length, row_prefix, window)
    rows, heads, queries, head_dim = query.shape
    query, key, value, shared_key, shared_value = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value, shared_key, shared_value)
    )
    out = torch.empty((rows, queries, heads, head_dim), dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    gather = order is not None
    order_arg = order if gather else count
    order_strides = (order.stride(0), order.stride(1) if order.shape[1] > 1 else 0) if gather else (0, 0)
    count_strides = (count.stride(0), count.stride(1) if count.shape[1] > 1 else 0)
    lengths = shared_length.to(torch.int32)
    if shared_key.numel() == 0:  # no prefix holds a key: the kernel reads none, but takes real pointers
        shared_key, shared_value, lengths = key, value, lengths.new_zeros(max(lengths.numel(), 1))
    grid = (rows * heads, triton.cdiv(queries, ATTENTION_BLOCK_Q))
    shared_prefix_attention_kernel[grid](
        query, key, value, shared_key, shared_value, out, order_arg, count, row_prefix.to(torch.int32), lengths,
        heads, heads // key.shape[1], queries, head_dim, float(scale), int(window),
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), shared_key.stride(0), shared_key.stride(1),
        shared_key.stride(2), shared_value.stride(0), shared_value.stride(1), shared_value.stride(2),
        out.stride(0), out.stride(1), out.stride(2), *order_strides, *count_strides,
        GATHER=gather, WALK=WALKS[walk], BLOCK_Q=ATTENTION_BLOCK_Q, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out


def _check(query, key, value, shared_key, shared_value, shared_length, row_prefix, window: int) -> None:
    """Refuse what the kernel would read out of bounds or misread, naming the argument."""
    rows, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"shared-prefix attention: query heads {heads} are not a multiple of key heads {kv_heads}")
    expected = (shared_key.shape[0], kv_heads, shared_key.shape[2], head_dim)
    for name, tensor in (("shared_key", shared_key), ("shared_value", shared_value)):
        if tuple(tensor.shape) != expected or tensor.dtype != key.dtype:
            raise ValueError(
                f"shared-prefix attention: {name} must be [prefixes, kv_heads={kv_heads}, longest, D={head_dim}] "
                f"in the keys' dtype {key.dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
            )
    if tuple(row_prefix.shape) != (rows,):
        raise ValueError(f"shared-prefix attention: row_prefix must be [rows={rows}], got {tuple(row_prefix.shape)}")
    if tuple(shared_length.shape) != (shared_key.shape[0],):
        raise ValueError(
            f"shared-prefix attention: shared_length must be [prefixes={shared_key.shape[0]}], got {tuple(shared_length.shape)}"
        )
    if window < 0:
        raise ValueError(f"shared-prefix attention: window must be 0 (none) or a positive width, got {window}")


@torch.library.custom_op("autobucket_triton::shared_prefix_attention", mutates_args=())
def shared_prefix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    order: torch.Tensor | None,
    count: torch.Tensor,
    shared_key: torch.Tensor,
    shared_value: torch.Tensor,
    shared_length: torch.Tensor,
    row_prefix: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """`launch_shared_prefix_attention` as one op (CUDA graphs and torch.compile capture it whole)."""
    return launch_shared_prefix_attention(
        query, key, value, order, count, shared_key, shared_value, shared_length, row_prefix, window, scale
    )


@shared_prefix_attention.register_fake
def _(query, key, value, order, count, shared_key, shared_value, shared_length, row_prefix, window, scale):
    rows, heads, queries, head_dim = query.shape
    return query.new_empty((rows, queries, heads, head_dim))


def shared_prefix_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    shared_key: torch.Tensor,
    shared_value: torch.Tensor,
    shared_length: torch.Tensor,
    row_prefix: torch.Tensor,
    window: int = 0,
) -> torch.Tensor:
    """The op from a forward's 4-D mask over the rows' own columns (bool or 0 / -inf; None: all of them):
    the C++ set's `invariant_attention_shared` arguments, less its tiles -> [rows, queries, heads, D]."""
    from autobucket.engine.kernels.invariant_attention import allowed_for

    rows, queries, columns = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is None:  # the own keys follow the prefix: causal over them
        order, count = None, causal_counts(rows, queries, columns, True, query.device)
    else:
        order, count = memoized_key_order(allowed_for(attention_mask, rows, columns), attention_mask)
    return shared_prefix_attention(
        query, key, value, order, count, shared_key, shared_value, shared_length, row_prefix, int(window), float(scale)
    )
