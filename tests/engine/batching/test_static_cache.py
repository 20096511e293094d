"""StaticKVCache on small random tensors: each operation checked against the layout it promises
(rows right-aligned to one shared front, an additive mask, host-side first columns)."""

from __future__ import annotations

import pytest
import torch
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine import routes
from autobucket.engine.batching import static_cache
from autobucket.engine.batching.static_cache import CacheCapacityError, StaticKVCache

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_thread")]

LAYERS, HEADS, DIM = 2, 2, 4
MASKED = torch.finfo(torch.float32).min


def make_store(rows: int = 3, columns: int = 10) -> StaticKVCache:
    return StaticKVCache(LAYERS, rows, HEADS, columns, DIM, torch.float32, "cpu")


def group_kv(rows: int, width: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V `[rows, heads, width, dim]` of a prefilled group (distinct random values)."""
    generator = torch.Generator().manual_seed(seed)
    keys = [torch.randn(rows, HEADS, width, DIM, generator=generator) for _ in range(LAYERS)]
    values = [torch.randn(rows, HEADS, width, DIM, generator=generator) for _ in range(LAYERS)]
    return keys, values


def live_columns(store: StaticKVCache, row: int) -> list[int]:
    return torch.nonzero(store.attend[row] == 0).flatten().tolist()


def decode_step(store: StaticKVCache, seed: int) -> list[torch.Tensor]:
    """One decode step on every active row through the store's own API; returns the keys written per layer."""
    store.prepare_step()
    written = []
    for layer in range(LAYERS):
        key, value = group_kv(store.active_rows, 1, seed + layer)
        store.write_step(layer, key[0], value[0])
        written.append(key[0])
    store.finish_step()
    return written


def snapshot(store: StaticKVCache) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    return [k.clone() for k in store.keys], [v.clone() for v in store.values], store.attend.clone()


# ---- admit -------------------------------------------------------------------------------------------


def test_admit_right_aligns_each_rows_real_tokens_to_end_at_the_front():
    store = make_store()
    keys, values = group_kv(2, 5, seed=0)
    rows = store.admit(keys, values, lengths=[5, 3])
    assert rows == range(0, 2)
    assert store.front == 5 and store.active_rows == 2
    assert store.first_column == [0, 2]
    for layer in range(LAYERS):
        for row, length in enumerate([5, 3]):
            # the row's real tokens are the group's last `length` columns
            torch.testing.assert_close(
                store.keys[layer][row, :, 5 - length : 5], keys[layer][row, :, 5 - length :]
            )
            torch.testing.assert_close(
                store.values[layer][row, :, 5 - length : 5], values[layer][row, :, 5 - length :]
            )
    assert live_columns(store, 0) == [0, 1, 2, 3, 4]
    assert live_columns(store, 1) == [2, 3, 4]
    assert (store.attend[1, :2] == MASKED).all() and (store.attend[:, 5:] == MASKED).all()
    assert (store.attend[2] == MASKED).all()  # a free row attends to nothing


def test_admit_narrower_group_ends_at_the_existing_front():
    store = make_store()
    store.admit(*group_kv(1, 6, seed=0), lengths=[6])
    keys, values = group_kv(1, 2, seed=1)
    assert store.admit(keys, values, lengths=[2]) == range(1, 2)
    assert store.front == 6
    assert store.first_column == [0, 4]
    assert live_columns(store, 1) == [4, 5]
    torch.testing.assert_close(store.keys[1][1, :, 4:6], keys[1][0])


def test_admitting_a_wider_group_moves_the_front_and_leaves_a_masked_gap_for_old_rows():
    store = make_store(columns=12)
    old_keys, _ = group_kv(1, 3, seed=0)
    store.admit(old_keys, group_kv(1, 3, seed=1)[0], lengths=[3])
    written = decode_step(store, seed=2)
    assert store.front == 4
    before_keys, _, _ = snapshot(store)

    new_keys, new_values = group_kv(1, 7, seed=3)
    store.admit(new_keys, new_values, lengths=[7])
    assert store.front == 7
    assert store.first_column == [0, 0]
    assert live_columns(store, 0) == [0, 1, 2, 3]  # columns 4..6 are a masked gap for the old row
    assert live_columns(store, 1) == list(range(7))
    for layer in range(LAYERS):
        torch.testing.assert_close(store.keys[layer][0, :, :4], before_keys[layer][0, :, :4])
        torch.testing.assert_close(store.keys[layer][0, :, 3:4], written[layer][0])
        torch.testing.assert_close(store.keys[layer][1, :, :7], new_keys[layer][0])


def test_admit_more_rows_than_are_free_is_rejected():
    store = make_store(rows=2)
    store.admit(*group_kv(1, 2, seed=0), lengths=[2])
    with pytest.raises(ValueError, match="only 1 of 2 are free"):
        store.admit(*group_kv(2, 2, seed=1), lengths=[2, 2])


def test_admit_at_a_full_front_keeps_room_for_the_new_rows_width():
    # Row A (length 6) and row B (length 1) share a front; A retires when the front reaches the
    # capacity. Admitting a width-5 group then trims the dead columns left of B, and the new rows
    # must still end at the front with all their 5 columns inside the cache.
    store = make_store(rows=2, columns=8)
    store.admit(*group_kv(1, 6, seed=0), lengths=[6])
    b_keys, b_values = group_kv(1, 1, seed=1)
    store.admit(b_keys, b_values, lengths=[1])
    decode_step(store, seed=2)
    decode_step(store, seed=3)
    assert store.front == store.columns == 8
    store.compact([1])  # A retires; B (first column 5) survives
    b_live = store.keys[0][0, :, 5:8].clone()

    new_keys, new_values = group_kv(1, 5, seed=4)
    store.admit(new_keys, new_values, lengths=[5])  # transformers' error today: slice [front-5:front) < 0
    front = store.front
    assert 5 <= front < store.columns
    torch.testing.assert_close(store.keys[0][1, :, front - 5 : front], new_keys[0][0])
    assert live_columns(store, 1) == list(range(front - 5, front))
    b_first = store.first_column[0]
    torch.testing.assert_close(store.keys[0][0, :, b_first : b_first + 3], b_live)
    assert live_columns(store, 0) == list(range(b_first, b_first + 3))


# ---- decode step -------------------------------------------------------------------------------------


def test_decode_step_writes_every_row_at_the_front_and_returns_views_up_to_it():
    store = make_store()
    store.admit(*group_kv(2, 4, seed=0), lengths=[4, 2])
    store.prepare_step()
    assert store.attend[0, 4] == 0 and store.attend[1, 4] == 0 and store.attend[2, 4] == MASKED
    mask = store.step_mask()
    assert mask.shape == (2, 1, 1, 5)
    assert mask.data_ptr() == store.attend.data_ptr()  # a view: nothing is rebuilt per step
    torch.testing.assert_close(mask[:, 0, 0], store.attend[:2, :5])

    key, value = group_kv(2, 1, seed=1)
    keys_view, values_view = store.write_step(1, key[0], value[0])
    assert keys_view.shape == values_view.shape == (2, HEADS, 5, DIM)
    torch.testing.assert_close(store.keys[1][:2, :, 4:5], key[0])
    torch.testing.assert_close(store.values[1][:2, :, 4:5], value[0])
    torch.testing.assert_close(keys_view, store.keys[1][:2, :, :5])
    assert keys_view.data_ptr() == store.keys[1].data_ptr()
    assert store.front == 4  # write_step does not advance: one front per forward, not per layer
    store.finish_step()
    assert store.front == 5


# ---- compact -----------------------------------------------------------------------------------------


def test_compact_moves_kept_rows_in_the_given_order_and_clears_the_rest():
    store = make_store(rows=3)
    store.admit(*group_kv(3, 4, seed=0), lengths=[4, 2, 3])
    decode_step(store, seed=1)
    keys, values, attend = snapshot(store)
    moved_before = store.moved_bytes

    store.compact([2, 0])
    assert store.active_rows == 2
    assert store.first_column == [1, 0]
    for layer in range(LAYERS):
        torch.testing.assert_close(store.keys[layer][0], keys[layer][2])
        torch.testing.assert_close(store.keys[layer][1], keys[layer][0])
        torch.testing.assert_close(store.values[layer][0], values[layer][2])
        torch.testing.assert_close(store.values[layer][1], values[layer][0])
        assert (store.keys[layer][2] == 0).all() and (store.values[layer][2] == 0).all()
    torch.testing.assert_close(store.attend[0], attend[2])
    torch.testing.assert_close(store.attend[1], attend[0])
    assert (store.attend[2] == MASKED).all()
    element = store.keys[0].element_size()
    assert store.moved_bytes - moved_before == 2 * LAYERS * 2 * HEADS * store.front * DIM * element


def test_retiring_rows_moves_only_the_rows_that_fill_the_holes():
    """Rows 1 and 3 of 6 retire: rows 4 and 5 fill their places and nothing else moves (two rows' bytes;
    keeping the input order would shift rows 2, 4 and 5). Every survivor's K/V and mask are its own."""
    store = make_store(rows=6)
    store.admit(*group_kv(6, 4, seed=0), lengths=[4, 2, 3, 1, 4, 2])
    decode_step(store, seed=1)
    keys, values, attend = snapshot(store)
    order = static_cache.fill_holes_order([0, 2, 4, 5])
    assert order == [0, 4, 2, 5]
    assert static_cache.fill_holes_order([0, 1, 2]) == [0, 1, 2]  # the last rows retired: nothing moves
    store.compact(order)
    for position, row in enumerate(order):
        for layer in range(LAYERS):
            assert torch.equal(store.keys[layer][position], keys[layer][row])
            assert torch.equal(store.values[layer][position], values[layer][row])
        assert torch.equal(store.attend[position], attend[row])
    element = store.keys[0].element_size()
    assert store.moved_bytes == 2 * LAYERS * 2 * HEADS * store.front * DIM * element


def test_compact_with_identity_keep_moves_nothing_and_clears_the_tail():
    store = make_store(rows=3)
    store.admit(*group_kv(3, 4, seed=0), lengths=[4, 2, 3])
    keys, _, attend = snapshot(store)
    store.compact([0, 1])
    assert store.moved_bytes == 0
    assert store.front == 4 and store.first_column == [0, 2]
    for layer in range(LAYERS):
        torch.testing.assert_close(store.keys[layer][:2], keys[layer][:2])
        assert (store.keys[layer][2] == 0).all() and (store.values[layer][2] == 0).all()
    torch.testing.assert_close(store.attend[:2], attend[:2])
    assert (store.attend[2] == MASKED).all()


def test_compact_to_no_rows_resets_the_front():
    store = make_store()
    store.admit(*group_kv(2, 4, seed=0), lengths=[4, 2])
    store.compact([])
    assert store.active_rows == 0 and store.front == 0 and store.first_column == []
    assert (store.attend == MASKED).all()
    assert all((k == 0).all() for k in store.keys)


# ---- trim --------------------------------------------------------------------------------------------


def test_trim_shifts_live_data_left_past_the_dead_columns():
    store = make_store(rows=2)
    store.admit(*group_kv(2, 6, seed=0), lengths=[6, 2])
    decode_step(store, seed=1)
    store.compact([1])  # only the length-2 row survives: columns 0..3 are dead
    keys, values, attend = snapshot(store)
    moved_before = store.moved_bytes

    assert store.trim() == 4
    assert store.front == 3 and store.first_column == [0]
    assert store.trims == 1 and store.trimmed_columns == 4
    for layer in range(LAYERS):
        torch.testing.assert_close(store.keys[layer][0, :, :3], keys[layer][0, :, 4:7])
        torch.testing.assert_close(store.values[layer][0, :, :3], values[layer][0, :, 4:7])
    assert live_columns(store, 0) == [0, 1, 2]
    assert (store.attend[0, 3:] == MASKED).all()
    element = store.keys[0].element_size()
    assert store.moved_bytes - moved_before == 2 * LAYERS * 1 * HEADS * 3 * DIM * element
    torch.testing.assert_close(attend[0, 4:7], store.attend[0, :3])

    assert store.trim() == 0  # nothing dead any more: no count, no move
    assert store.trims == 1 and store.moved_bytes - moved_before == 2 * LAYERS * HEADS * 3 * DIM * element


def test_prepare_step_trims_when_the_front_reaches_the_capacity():
    store = make_store(rows=2, columns=6)
    store.admit(*group_kv(2, 5, seed=0), lengths=[5, 1])
    decode_step(store, seed=1)
    store.compact([1])
    assert store.front == 6 == store.columns
    store.prepare_step()
    assert store.trims == 1 and store.front == 2
    assert store.attend[0, 2] == 0


# ---- capacity ----------------------------------------------------------------------------------------


def test_capacity_error_when_no_dead_column_can_be_trimmed():
    store = make_store(rows=1, columns=5)
    store.admit(*group_kv(1, 4, seed=0), lengths=[4])
    decode_step(store, seed=1)
    assert store.front == 5
    with pytest.raises(CacheCapacityError) as info:
        store.prepare_step()
    assert isinstance(info.value, ValueError)
    assert "cache_capacity" in str(info.value) and "trim_cache" in str(info.value)


def test_capacity_error_when_a_prefill_is_wider_than_the_cache_allows():
    store = make_store(columns=5)
    with pytest.raises(CacheCapacityError, match="cache_capacity is 5"):
        store.admit(*group_kv(1, 6, seed=0), lengths=[6])  # 6 columns > 5
    assert store.active_rows == 0
    store.admit(*group_kv(1, 5, seed=0), lengths=[5])  # fits exactly; only a decode step needs a 6th
    with pytest.raises(CacheCapacityError, match="cache_capacity.*trim_cache"):
        store.prepare_step()


# ---- hf_cache and bookkeeping ------------------------------------------------------------------------


def test_hf_cache_is_a_transformers_cache_whose_update_writes_at_the_front():
    from transformers.cache_utils import Cache

    store = make_store()
    store.admit(*group_kv(2, 3, seed=0), lengths=[3, 1])
    store.prepare_step()
    cache = store.hf_cache()
    assert isinstance(cache, Cache)
    assert len(cache.layers) == LAYERS
    assert cache.get_seq_length() == 3
    key, value = group_kv(2, 1, seed=1)
    keys_view, values_view = cache.update(key[0], value[0], 1)
    assert keys_view.shape == (2, HEADS, 4, DIM)
    torch.testing.assert_close(store.keys[1][:2, :, 3:4], key[0])
    torch.testing.assert_close(values_view[:, :, 3:4], value[0])
    assert (store.keys[0][:, :, 3] == 0).all()  # another layer's column is untouched
    store.finish_step()
    assert cache.get_seq_length() == 4


def test_nbytes_counts_keys_values_and_mask():
    store = make_store(rows=3, columns=10)
    assert store.nbytes == (2 * LAYERS * 3 * HEADS * 10 * DIM + 3 * 10) * 4
    assert store.free_rows == 3


# ---- the unmasked decode fast path -------------------------------------------------------------------


def test_step_mask_is_none_only_when_every_row_owns_every_column():
    store = make_store(columns=12)
    store.admit(*group_kv(2, 4, seed=0), lengths=[4, 4])
    store.prepare_step()
    assert store.step_mask() is None  # uniform rows from column 0: nothing to mask
    store.finish_step()
    store.admit(*group_kv(1, 3, seed=1), lengths=[3])  # starts at column 2
    store.prepare_step()
    mask = store.step_mask()
    assert mask is not None and mask[2, 0, 0, :2].eq(store.masked_value).all()
    store.finish_step()
    store.compact([0, 1])
    store.prepare_step()
    assert store.step_mask() is None  # the short row retired
    store.finish_step()
    store.admit(*group_kv(1, 9, seed=2), lengths=[9])  # wider than the front: old rows get a gap
    store.prepare_step()
    assert store.step_mask() is not None
    store.trim()  # a trim removes dead columns on the left, never a gap in the middle
    assert store.step_mask() is not None


# ---------------------------------------------------------------- storage left unzeroed for the own kernel
def _poisoned_storage(monkeypatch, force_unzeroed: bool = False) -> list[bool]:
    """Every StaticKVCache built from here on: storage that is not zero-filled holds NaN (the worst a fresh
    allocation can hold) instead of whatever memory it got. Returns each store's zero_filled, in order."""
    original = static_cache.StaticKVCache.__init__
    seen: list[bool] = []

    def init(self, *args, **kwargs):
        if force_unzeroed:
            kwargs["zero_filled"] = False
        original(self, *args, **kwargs)
        seen.append(self.zero_filled)
        if not self.zero_filled:
            for tensor in (*self.keys, *self.values):
                tensor.fill_(float("nan"))

    monkeypatch.setattr(static_cache.StaticKVCache, "__init__", init)
    return seen


def _mixed_call(model, kernels: str):
    # lengths 3..41: rows own few of the columns; 5 rows at once for 8 prompts x 2 samples: refills and
    # retirements (compaction) while others decode
    prompts = random_prompts([41, 3, 17, 29, 8, 36, 12, 5], seed=91)
    sampling = SamplingConfig(max_new_tokens=6, eos_token_id=[], n=2, temperature=1.0, seed=5, logprobs=True,
                              continuous_batch_size=5)  # fmt: skip
    config = RolloutConfig(route="aligned", kernels=kernels, persist_costs=False)
    return Rollout(model, config=config).generate(prompts, sampling)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_invariant_kernels_never_read_columns_a_row_does_not_own(tiny_models, arch, monkeypatch):
    """With kernels="invariant" the cache is not zero-filled (every read skips unowned columns): NaN
    there changes no token or logprob bit against the zero-filled cache."""
    model = tiny_models(arch)
    zeroed = _mixed_call(model, "invariant")
    seen = _poisoned_storage(monkeypatch)
    poisoned = _mixed_call(model, "invariant")
    assert seen and not any(seen), "the invariant kernels' cache should skip zero-filling"
    assert poisoned.tokens == zeroed.tokens
    assert poisoned.logprobs == zeroed.logprobs


def test_control_sdpa_over_an_unzeroed_cache_breaks_the_oracle(tiny_models, monkeypatch):
    """Negative control: the default kernels with decode on transformers' SDPA (which reads masked
    columns) over NaN-filled storage give NaN logits (which the sampler refuses, naming the rows), so
    zero_filled=True there is what keeps them exact."""
    model = tiny_models("tiny-llama")
    monkeypatch.setattr(routes, "_decode_attention", lambda call: None)
    clean = _mixed_call(model, "hf")
    seen = _poisoned_storage(monkeypatch)
    assert _mixed_call(model, "hf").logprobs == clean.logprobs and all(seen), "the SDPA path zero-fills"
    _poisoned_storage(monkeypatch, force_unzeroed=True)
    with pytest.raises(RuntimeError, match=r"cannot sample prompt \d+ \(sample \d+, new token \d+\).*logits hold NaN"):
        _mixed_call(model, "hf")
