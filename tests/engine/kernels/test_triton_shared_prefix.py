"""The Triton shared-prefix decode attention under Triton's interpreter (fp32, toy sizes): rows that read a
shared prefix's one copy of K/V and then their own columns get bitwise the per-row Triton attention over
the row's whole sequence, and the trainer's one-shot prefill's bits for the same query; controls that walk
the prefix in blocks counted from anywhere else break it."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels then run on CPU tensors

import pytest
import torch

pytest.importorskip("triton")

from autobucket.engine.kernels.triton.attention import key_order, launch_attention  # noqa: E402
from autobucket.engine.kernels.triton.shared_prefix_attention import (  # noqa: E402
    launch_shared_prefix_attention,
    shared_prefix_attention,
    shared_prefix_decode_attention,
)

HEADS, KV_HEADS, DIM, SCALE = 4, 2, 16, 0.25
PREFIX_LENGTHS = (45, 70)  # neither a multiple of the 32-key block: a block straddles each prefix's end
ROW_PREFIX = (0, 0, 1, 1, -1)  # two rows on each prefix, one row without one
OWN_COLUMNS = 40


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def decode_batch(own_lengths: tuple[int, ...], gap_row: int | None = 1) -> dict:
    """One decode step of len(ROW_PREFIX) rows. The prefixes' copy [2, KV_HEADS, 70, DIM] holds noise past
    each prefix's length; each row's own keys sit right-aligned among OWN_COLUMNS columns with noise
    before them (and `gap_row`'s with a hole of 3 masked columns among them)."""
    rows = len(ROW_PREFIX)
    shared_key, shared_value = randn(2, KV_HEADS, max(PREFIX_LENGTHS), DIM, seed=1), randn(2, KV_HEADS, max(PREFIX_LENGTHS), DIM, seed=2)
    for prefix, length in enumerate(PREFIX_LENGTHS):  # never to be read: large, so a read shows
        shared_key[prefix, :, length:] *= 50
        shared_value[prefix, :, length:] *= 50
    allowed = torch.zeros(rows, 1, OWN_COLUMNS, dtype=torch.bool)
    for row, own in enumerate(own_lengths):
        allowed[row, 0, OWN_COLUMNS - own :] = True
    if gap_row is not None:
        allowed[gap_row, 0, OWN_COLUMNS - 6 : OWN_COLUMNS - 3] = False
    return {
        "query": randn(rows, HEADS, 1, DIM, seed=3), "key": randn(rows, KV_HEADS, OWN_COLUMNS, DIM, seed=4) * 3,
        "value": randn(rows, KV_HEADS, OWN_COLUMNS, DIM, seed=5), "allowed": allowed, "shared_key": shared_key,
        "shared_value": shared_value, "shared_length": torch.tensor(PREFIX_LENGTHS),
        "row_prefix": torch.tensor(ROW_PREFIX),
    }  # fmt: skip


def shared_prefix_decode(batch: dict, window: int = 0, walk: str = "sequence") -> torch.Tensor:
    order, count = key_order(batch["allowed"])
    return launch_shared_prefix_attention(
        batch["query"], batch["key"], batch["value"], order, count, batch["shared_key"], batch["shared_value"],
        batch["shared_length"], batch["row_prefix"], window, SCALE, walk=walk,
    )  # fmt: skip


def full_sequences(batch: dict, window: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row holding its whole sequence itself: a cache [rows, KV_HEADS, 9 + 70 + OWN_COLUMNS, DIM] of
    noise with the row's prefix copied in at column 9 and its own columns right after, and the allowed
    mask [rows, 1, columns] of that sequence (its newest `window` keys under a window)."""
    rows, offset = len(ROW_PREFIX), 9
    columns = offset + max(PREFIX_LENGTHS) + OWN_COLUMNS
    caches = [randn(rows, KV_HEADS, columns, DIM, seed=6 + i) * 50 for i in range(2)]
    allowed = torch.zeros(rows, 1, columns, dtype=torch.bool)
    for row, prefix in enumerate(ROW_PREFIX):
        length = PREFIX_LENGTHS[prefix] if prefix >= 0 else 0
        for cache, shared, own in zip(caches, ("shared_key", "shared_value"), ("key", "value"), strict=True):
            if length:
                cache[row, :, offset : offset + length] = batch[shared][prefix, :, :length]
            cache[row, :, offset + length : offset + length + OWN_COLUMNS] = batch[own][row]
        allowed[row, 0, offset : offset + length] = True
        allowed[row, 0, offset + length : offset + length + OWN_COLUMNS] = batch["allowed"][row, 0]
        if window:
            keys = allowed[row, 0].nonzero()[:, 0]
            allowed[row, 0, keys[:-window]] = False
    return caches[0], caches[1], allowed


def per_row_decode(batch: dict, window: int = 0) -> torch.Tensor:
    key, value, allowed = full_sequences(batch, window)
    order, count = key_order(allowed)
    return launch_attention(batch["query"], key, value, order, count, SCALE)


def reference(query, key, value, allowed) -> torch.Tensor:
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed[:, None], scale=SCALE, enable_gqa=True)
    return out.transpose(1, 2)


def test_rows_on_a_shared_prefix_get_the_per_row_kernels_bits_over_their_whole_sequence():
    batch = decode_batch(own_lengths=(1, 17, 30, 33, 12))
    out = shared_prefix_decode(batch)
    per_row = per_row_decode(batch)
    assert torch.equal(out, per_row)
    key, value, allowed = full_sequences(batch)
    torch.testing.assert_close(out, reference(batch["query"], key, value, allowed), rtol=1e-5, atol=1e-5)
    split = shared_prefix_decode(batch, walk="split")  # control: the own keys' blocks restart after the prefix
    assert all(not torch.equal(split[row], per_row[row]) for row in range(4))
    assert torch.equal(split[4], per_row[4])  # the row without a prefix walks only its own keys


def test_a_decoded_query_has_the_trainers_one_shot_prefill_bits():
    """Row 2's sequence (prefix 1, then 24 own keys, the last its query's own): its decode query at the
    sequence's last position against the same query inside the teacher-forced prefill of the sequence."""
    batch = decode_batch(own_lengths=(1, 5, 24, 2, 7), gap_row=None)
    length = PREFIX_LENGTHS[1] + 24
    key = torch.cat([batch["shared_key"][1, :, : PREFIX_LENGTHS[1]], batch["key"][2, :, -24:]], dim=1)[None]
    value = torch.cat([batch["shared_value"][1, :, : PREFIX_LENGTHS[1]], batch["value"][2, :, -24:]], dim=1)[None]
    queries = randn(1, HEADS, length, DIM, seed=12)
    queries[:, :, -1] = batch["query"][2, :, 0]
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None]
    prefill = launch_attention(queries, key, value, *key_order(causal), SCALE)
    assert torch.equal(shared_prefix_decode(batch)[2, 0], prefill[0, -1])
    split = shared_prefix_decode(batch, walk="split")
    assert not torch.equal(split[2, 0], prefill[0, -1])  # control


def test_a_window_reads_the_prefix_keys_it_still_covers_counted_from_the_windows_first_key():
    """Window 36: rows with 1, 17, 29 own keys read the newest 35, 19, 7 keys of their prefix (from its
    columns 10, 26, 63); a row with 40 own keys, narrowed to the window's 36 as the engine's mask is,
    reads none of it."""
    window = 36
    batch = decode_batch(own_lengths=(1, 17, 29, 40, 12), gap_row=None)
    batch["allowed"][3, 0, : OWN_COLUMNS - window] = False
    out = shared_prefix_decode(batch, window)
    per_row = per_row_decode(batch, window)
    assert torch.equal(out, per_row)
    key, value, allowed = full_sequences(batch, window)
    torch.testing.assert_close(out, reference(batch["query"], key, value, allowed), rtol=1e-5, atol=1e-5)
    copy = shared_prefix_decode(batch, window, walk="copy")  # control: blocks counted from the copy's column 0
    assert all(not torch.equal(copy[row], per_row[row]) for row in range(3))
    assert (shared_prefix_decode(batch) - per_row).abs().max() > 1e-3  # control: the window ignored


def test_the_op_from_a_forwards_mask_is_the_launch():
    batch = decode_batch(own_lengths=(3, 9, 40, 21, 5))
    mask = batch["allowed"][:, None]  # [rows, 1, 1, columns] bool, as a forward hands attention
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    arguments = (batch["shared_key"], batch["shared_value"], batch["shared_length"], batch["row_prefix"])
    expected = shared_prefix_decode(batch)
    for given in (mask, additive):
        out = shared_prefix_decode_attention(batch["query"], batch["key"], batch["value"], given, SCALE, *arguments)
        assert torch.equal(out, expected)
    everything = shared_prefix_decode_attention(batch["query"], batch["key"], batch["value"], None, SCALE, *arguments)
    batch["allowed"][:] = True
    assert torch.equal(everything, shared_prefix_decode(batch))


def test_rows_without_a_prefix_and_no_prefix_at_all_are_the_per_row_kernel():
    batch = decode_batch(own_lengths=(3, 9, 40, 21, 5))
    order, count = key_order(batch["allowed"])
    nothing = torch.empty(0, KV_HEADS, 0, DIM)
    out = shared_prefix_attention(
        batch["query"], batch["key"], batch["value"], order, count, nothing, nothing,
        torch.empty(0, dtype=torch.long), torch.full((5,), -1), 0, SCALE,
    )  # fmt: skip
    assert torch.equal(out, launch_attention(batch["query"], batch["key"], batch["value"], order, count, SCALE))


def test_bad_arguments_are_refused_naming_the_argument():
    batch = decode_batch(own_lengths=(3, 9, 40, 21, 5))
    order, count = key_order(batch["allowed"])

    def call(**change):
        arguments = {**{k: batch[k] for k in ("query", "key", "value", "shared_key", "shared_value", "shared_length", "row_prefix")},
                     "order": order, "count": count, "window": 0, "scale": SCALE, **change}  # fmt: skip
        return launch_shared_prefix_attention(**arguments)

    with pytest.raises(ValueError, match="shared_key must be"):
        call(shared_key=batch["shared_key"][:, :1])
    with pytest.raises(ValueError, match="shared_value must be .* dtype"):
        call(shared_value=batch["shared_value"].double())
    with pytest.raises(ValueError, match="row_prefix must be"):
        call(row_prefix=batch["row_prefix"][:3])
    with pytest.raises(ValueError, match="shared_length must be"):
        call(shared_length=torch.tensor([45]))
    with pytest.raises(ValueError, match="window must be"):
        call(window=-1)
    assert torch.equal(call(), shared_prefix_decode(batch))  # usable after the refusals
