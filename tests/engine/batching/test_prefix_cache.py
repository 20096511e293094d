"""The prefix KV cache (`RolloutConfig(prefix_cache_mb=...)`) against oracles that can fail.

- The block tree alone: what `lookup` returns is exactly the K/V columns that were inserted for those
  tokens (a brute-force slice of the inserted tensors), for full blocks, a prompt that diverges inside a
  block, partial tail blocks, least-recently-used eviction under the budget, a sequence over the budget.
- Multi-turn on six architectures: each turn's tokens equal single-request HF `generate` over the whole
  conversation, and turns 2 and 3 prefill only their new tokens (`prefill_tokens` and
  `cached_prompt_tokens` checked exactly on the aligned route).
- Weights: an optimizer step, `load_state_dict` and `refresh_weights()` between turns mean no reuse and
  the tokens of a fresh `Rollout` on the updated model; the negative control, a cache keyed without the
  weights' version, must break that oracle.
- `kernels="invariant"`: a continued conversation's tokens and logprobs equal a one-shot prefill's bitwise,
  with n samples and refills.
"""

from __future__ import annotations

import random

import pytest
import torch
from oracles import forget_oracle, oracle_generate
from workloads import ARCHS, random_prompts

from autobucket import CostCoefficients, Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.batching import prefix_cache as prefix_cache_module
from autobucket.engine.batching.prefix_cache import BLOCK_TOKENS, MIN_HIT_TOKENS, PrefixCache
from autobucket.models import build_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_thread")]

BUDGET = 8  # new tokens a turn
GREEDY = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[])


# ------------------------------------------------------------------ the block tree alone
def _sequence_kv(length: int, seed: int, layers: int = 2, heads: int = 2, dim: int = 4):
    """Distinct K/V per (layer, head, token): keys[l], values[l] [heads, length, dim]."""
    generator = torch.Generator().manual_seed(seed)
    keys = [torch.randn(heads, length, dim, generator=generator) for _ in range(layers)]
    values = [torch.randn(heads, length, dim, generator=generator) for _ in range(layers)]
    return keys, values


def _insert(cache: PrefixCache, tokens, keys, values) -> None:
    cache.insert(tokens, lambda start: ([k[:, start:] for k in keys], [v[:, start:] for v in values]))


def _assert_hit(cache: PrefixCache, prompt, expected_tokens: int, keys, values) -> None:
    hit = cache.lookup(prompt)
    assert hit is not None and hit.tokens == expected_tokens
    for layer in range(len(keys)):
        assert torch.equal(hit.keys[layer], keys[layer][:, :expected_tokens])
        assert torch.equal(hit.values[layer], values[layer][:, :expected_tokens])


def test_lookup_returns_the_inserted_columns_of_the_longest_common_prefix():
    cache = PrefixCache(budget_bytes=1 << 20)
    tokens = list(range(100, 150))  # 50 tokens: 3 full blocks and a 2-token tail
    keys, values = _sequence_kv(len(tokens), seed=1)
    _insert(cache, tokens, keys, values)
    _assert_hit(cache, tokens + [7, 8], 50, keys, values)  # extends the whole sequence
    _assert_hit(cache, tokens, 49, keys, values)  # the same prompt: its last token is prefilled
    _assert_hit(cache, tokens[:37] + [1, 2, 3], 37, keys, values)  # diverges inside the third block
    _assert_hit(cache, tokens[:20] + [9] * 30, 20, keys, values)  # inside the second block
    assert cache.lookup(tokens[:MIN_HIT_TOKENS - 1] + [9] * 30) is None  # too short to be worth a forward
    assert cache.lookup([9] + tokens) is None  # differs at the first token


def test_a_longer_sequence_replaces_a_cached_tail_and_shares_the_common_blocks():
    cache = PrefixCache(budget_bytes=1 << 20)
    tokens = list(range(200, 240))
    keys, values = _sequence_kv(60, seed=2)
    _insert(cache, tokens[:21], [k[:, :21] for k in keys], [v[:, :21] for v in values])  # 1 block + 5-token tail
    assert cache.blocks == 2
    longer = tokens + list(range(20))  # 60 tokens with the same first 21
    _insert(cache, longer, keys, values)
    assert cache.blocks == 4  # the tail block was replaced by a full block; nothing duplicated
    _assert_hit(cache, longer + [5], 60, keys, values)
    assert cache.used_bytes == 60 * 2 * 2 * 2 * 4 * 4  # tokens * layers * (k, v) * heads * dim * fp32 bytes


def test_lru_eviction_keeps_the_budget_and_the_recently_used_sequence():
    block_bytes = 2 * 2 * 2 * BLOCK_TOKENS * 4 * 4  # layers * (k, v) * heads * tokens * dim * fp32
    cache = PrefixCache(budget_bytes=4 * block_bytes)
    sequences = [[1000 * (i + 1) + t for t in range(32)] for i in range(3)]  # two blocks each
    kvs = [_sequence_kv(32, seed=10 + i) for i in range(3)]
    _insert(cache, sequences[0], *kvs[0])
    _insert(cache, sequences[1], *kvs[1])
    _assert_hit(cache, sequences[0] + [1], 32, *kvs[0])  # sequence 0 is now the most recent
    _insert(cache, sequences[2], *kvs[2])  # needs two blocks: sequence 1 (least recent) goes
    assert cache.used_bytes <= cache.budget_bytes and cache.stats.evicted_blocks == 2
    assert cache.lookup(sequences[1] + [1]) is None
    _assert_hit(cache, sequences[0] + [1], 32, *kvs[0])
    _assert_hit(cache, sequences[2] + [1], 32, *kvs[2])


def test_a_sequence_over_the_whole_budget_is_not_cached_and_nothing_is_evicted_for_it():
    cache = PrefixCache(budget_bytes=2 * 2 * 2 * BLOCK_TOKENS * 4 * 4)  # one block
    small, large = list(range(16)), list(range(50, 100))
    _insert(cache, small, *_sequence_kv(16, seed=3))
    _insert(cache, large, *_sequence_kv(50, seed=4))
    assert cache.stats.skipped_sequences == 1 and cache.blocks == 1
    assert cache.lookup(large) is None and cache.lookup(small + [1]) is not None


def test_a_new_version_empties_the_cache():
    cache = PrefixCache(budget_bytes=1 << 20)
    cache.use_version(("v", 1))
    tokens = list(range(40))
    _insert(cache, tokens, *_sequence_kv(40, seed=5))
    assert cache.use_version(("v", 1)) is False and cache.lookup(tokens) is not None
    assert cache.use_version(("v", 2)) is True
    assert cache.lookup(tokens) is None and cache.used_bytes == 0 and cache.stats.invalidations == 1


@pytest.mark.parametrize("megabytes", [-1, float("nan"), "64", True])
def test_a_bad_budget_names_the_field(megabytes):
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        RolloutConfig(prefix_cache_mb=megabytes)


# ------------------------------------------------------------------ multi-turn on real models
def _turns(rollout: Rollout, first_prompts, turns: int, seed: int, sampling=GREEDY):
    """Run `turns` turns: each next prompt = conversation + generated tokens + a random "tool" reply.
    Returns per turn (prompts, result)."""
    rng, conversations, history = random.Random(seed), [list(p) for p in first_prompts], []
    for turn in range(turns):
        result = rollout.generate(conversations, sampling)
        history.append((conversations, result))
        tools = random_prompts([rng.randint(1, 20) for _ in conversations], seed=seed * 100 + turn)
        completions = result.tokens if sampling.n == 1 else [samples[0] for samples in result.tokens]
        conversations = [c + t + x for c, t, x in zip(conversations, completions, tools, strict=True)]
    return history


def _assert_oracle(model, prompts, result) -> None:
    for index, (prompt, tokens) in enumerate(zip(prompts, result.tokens, strict=True)):
        expected, _ = oracle_generate(model, prompt, BUDGET, eos_token_id=[])
        assert tokens == expected, f"prompt {index} ({len(prompt)} tokens) differs from model.generate"


@pytest.mark.parametrize("arch", ARCHS)
def test_three_turns_equal_generate_and_prefill_only_new_tokens(tiny_models, arch):
    model = tiny_models(arch)
    rollout = Rollout(model, config=RolloutConfig(route="aligned", prefix_cache_mb=16))
    first = random_prompts([30, 17, 52, 21], seed=ARCHS.index(arch))
    history = _turns(rollout, first, turns=3, seed=ARCHS.index(arch))
    for turn, (prompts, result) in enumerate(history):
        _assert_oracle(model, prompts, result)
        if turn == 0:
            assert result.profile.cached_prompt_tokens == 0
            continue
        previous_prompts, previous = history[turn - 1]
        # Every token of the previous turn has K/V but its last generated one (never fed back).
        cached = [len(p) + len(t) - 1 for p, t in zip(previous_prompts, previous.tokens, strict=True)]
        assert result.profile.cached_prompt_tokens == sum(cached)
        assert result.profile.prefix_cache_hits == len(prompts)
        assert result.profile.prefill_tokens == sum(len(p) for p in prompts) - sum(cached)
        assert set(result.profile.prefill_forms[0]) == {"continued"}


@pytest.mark.parametrize("route", ["equal_width", "bucketed", "auto"])
def test_every_cb_route_continues_with_refill_packing_and_chunks(tiny_models, route):
    """5 conversations on 2 cache rows (refills admit hits), packing on, and a token budget of 12 that
    chunks the long continuations."""
    model = tiny_models("tiny-qwen2")
    config = RolloutConfig(route=route, prefix_cache_mb=16, prefill_max_tokens=48, packing=True)
    rollout = Rollout(model, config=config)
    sampling = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], continuous_batch_size=2)
    history = _turns(rollout, random_prompts([40, 9, 33, 20, 45], seed=7), turns=3, seed=7, sampling=sampling)
    for turn, (prompts, result) in enumerate(history):
        _assert_oracle(model, prompts, result)
        if turn:
            assert result.profile.prefix_cache_hits == len(prompts)
            assert result.profile.route != "ordinary"


def test_continued_groups_enter_the_cache_in_their_rows_order(tiny_models, monkeypatch):
    """A continued group's rows are admitted in the order its prefill returned them, so its K/V is copied
    into the static cache as one block (not gathered into another copy first), and the tokens stay the
    oracle's. Continued groups are formed by length, so the queue's prompt order differs from theirs."""
    from autobucket.engine.batching import model_runner

    admitted: list[tuple[bool, list[int]]] = []
    original = model_runner.ModelRunner._admit_plain

    def recording(self, output, source_rows, lengths):
        admitted.append((output.segments is None, list(source_rows)))
        return original(self, output, source_rows, lengths)

    monkeypatch.setattr(model_runner.ModelRunner, "_admit_plain", recording)
    model = tiny_models("tiny-llama")
    rollout = Rollout(model, config=RolloutConfig(route="bucketed", prefix_cache_mb=16))
    history = _turns(rollout, random_prompts([12, 47, 25, 38, 30, 19], seed=21), turns=2, seed=21)
    prompts, result = history[1]
    _assert_oracle(model, prompts, result)
    assert set(result.profile.prefill_forms[0]) == {"continued"}
    continued = [rows for padded, rows in admitted[-len(result.profile.prefill_groups[0]) :] if padded]
    assert continued and all(rows == list(range(len(rows))) for rows in continued), continued
    assert any(group != sorted(group) for group in result.profile.prefill_groups[0]), "groups in prompt order test nothing"


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-opt", "tiny-gpt2"])
def test_eager_attention_models_continue_a_padded_group_exactly(tiny_models, arch):
    """Eager attention adds the continuation's 4-D mask to its scores itself (no dispatcher, no SDPA): a
    group of several rows with different suffix lengths (padding inside the group) still equals generate."""
    model = tiny_models(arch, attn_implementation="eager")
    rollout = Rollout(model, config=RolloutConfig(route="bucketed", prefix_cache_mb=16))
    history = _turns(rollout, random_prompts([12, 47, 25, 38, 30, 19], seed=21), turns=3, seed=21)
    for turn, (prompts, result) in enumerate(history):
        _assert_oracle(model, prompts, result)
        if turn:
            assert set(result.profile.prefill_forms[0]) == {"continued"}
            assert max(map(len, result.profile.prefill_groups[0])) > 1, "no padded group to test"


def test_negative_control_padding_tokens_writing_over_the_prefix_break_the_oracle(tiny_models, monkeypatch):
    """The continuation's buffer holds a row's prefix where the shorter suffixes' padding tokens sit in the
    input; a cache that stores every input column's K/V (padding included) overwrites those prefixes, and
    the oracle must notice."""
    from autobucket.engine.batching import continued_prefill

    def write_everything(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.real = torch.ones_like(self.real)
        return original(self, key_states, value_states, layer_idx)

    original = continued_prefill._ContinuationCache.update
    monkeypatch.setattr(continued_prefill._ContinuationCache, "update", write_everything)
    model = tiny_models("tiny-llama")
    rollout = Rollout(model, config=RolloutConfig(route="bucketed", prefix_cache_mb=16))
    history = _turns(rollout, random_prompts([12, 47, 25, 38, 30, 19], seed=21), turns=2, seed=21)
    prompts, result = history[1]
    assert max(map(len, result.profile.prefill_groups[0])) > 1, "a group of one row has no padding to test"
    with pytest.raises(AssertionError, match="differs from model.generate"):
        _assert_oracle(model, prompts, result)


def test_a_prompt_diverging_inside_a_cached_sequence_reuses_the_common_part(tiny_models):
    model = tiny_models("tiny-llama")
    rollout = Rollout(model, config=RolloutConfig(route="aligned", prefix_cache_mb=16))
    first = random_prompts([60], seed=11)[0]
    rollout.generate([first], GREEDY)
    diverging = first[:37] + random_prompts([12], seed=12)[0]
    result = rollout.generate([diverging], GREEDY)
    assert result.profile.cached_prompt_tokens == 37
    _assert_oracle(model, [diverging], result)


def test_a_budget_too_small_for_one_sequence_caches_nothing_and_stays_exact(tiny_models):
    model = tiny_models("tiny-qwen2")
    rollout = Rollout(model, config=RolloutConfig(route="aligned", prefix_cache_mb=0.001))  # ~1 KB
    history = _turns(rollout, random_prompts([40, 30], seed=13), turns=2, seed=13)
    for prompts, result in history:
        _assert_oracle(model, prompts, result)
        assert result.profile.cached_prompt_tokens == 0 and result.profile.prefix_cache_bytes == 0
    assert rollout.prefix_cache.stats.skipped_sequences == 4


def test_the_cost_probe_never_fills_the_cache(tiny_models):
    """Online costs probe the model with their own prompts first; only the user's sequences are cached."""
    model = tiny_models("tiny-qwen2")
    rollout = Rollout(model, config=RolloutConfig(route="auto", costs=None, persist_costs=False, prefix_cache_mb=16))
    rollout.generate(random_prompts([20, 24], seed=14), GREEDY)
    assert rollout.prefix_cache.stats.inserted_sequences == 2


# ------------------------------------------------------------------ weights' version
def _fresh_model(seed: int = 0):
    return build_tiny_model("tiny-qwen2", seed=seed)


def _optimizer_step(model) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor([random_prompts([24], seed=15)[0]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _turn_two_after(update, key_without_version: bool, monkeypatch):
    """Turn 1, `update(model)`, then turn 2: (model, turn-2 prompts, turn-2 result)."""
    if key_without_version:
        monkeypatch.setattr("autobucket.engine.rollout.weights_version", lambda model, *extra: ("constant",))
    model = _fresh_model()
    rollout = Rollout(model, config=RolloutConfig(route="aligned", prefix_cache_mb=16))
    first = random_prompts([40, 28, 50], seed=16)
    result = rollout.generate(first, GREEDY)
    update(model, rollout)
    forget_oracle(model)
    tools = random_prompts([5, 9, 3], seed=17)
    second = [p + t + x for p, t, x in zip(first, result.tokens, tools, strict=True)]
    return model, second, rollout.generate(second, GREEDY)


def _load_other_weights(model, rollout) -> None:
    model.load_state_dict(_fresh_model(seed=1).state_dict())


def _data_copy_then_refresh(model, rollout) -> None:
    other = _fresh_model(seed=2).state_dict()
    for name, parameter in model.named_parameters():
        parameter.data.copy_(other[name])  # bypasses version counters
    rollout.refresh_weights()


UPDATES = {
    "optimizer_step": lambda model, rollout: _optimizer_step(model),
    "load_state_dict": _load_other_weights,
    "data_copy_and_refresh_weights": _data_copy_then_refresh,
}


@pytest.mark.parametrize("update", list(UPDATES))
def test_a_weight_update_between_turns_means_no_reuse(update, monkeypatch):
    model, prompts, result = _turn_two_after(UPDATES[update], key_without_version=False, monkeypatch=monkeypatch)
    assert result.profile.cached_prompt_tokens == 0
    if update != "data_copy_and_refresh_weights":  # refresh_weights() emptied it before the call
        assert result.profile.prefix_cache_invalidations == 1
    _assert_oracle(model, prompts, result)
    fresh = Rollout(model, config=RolloutConfig(route="aligned")).generate(prompts, GREEDY)
    assert result.tokens == fresh.tokens


def test_negative_control_a_cache_keyed_without_the_weights_version_serves_stale_kv(monkeypatch):
    model, prompts, result = _turn_two_after(UPDATES["optimizer_step"], key_without_version=True, monkeypatch=monkeypatch)
    assert result.profile.cached_prompt_tokens > 0  # stale K/V reused
    expected = [oracle_generate(model, p, BUDGET, eos_token_id=[])[0] for p in prompts]
    assert result.tokens != expected, "the oracle did not catch stale K/V: the test could not fail"


def test_another_attention_backend_is_another_version(tiny_models):
    model = _fresh_model()
    rollout = Rollout(model, config=RolloutConfig(route="aligned", prefix_cache_mb=16))
    prompts = random_prompts([30], seed=18)
    result = rollout.generate(prompts, GREEDY)
    continued = [prompts[0] + result.tokens[0] + [5, 6]]
    model.config._attn_implementation = "eager"
    try:
        second = rollout.generate(continued, GREEDY)
    finally:
        model.config._attn_implementation = "sdpa"
    assert second.profile.cached_prompt_tokens == 0 and second.profile.prefix_cache_invalidations == 1


def test_two_rollouts_never_share_entries(tiny_models):
    """Each Rollout owns its cache: a second model's Rollout cannot see the first one's sequences."""
    first_model, second_model = tiny_models("tiny-qwen2"), tiny_models("tiny-llama")
    prompts = random_prompts([40], seed=19)
    first = Rollout(first_model, config=RolloutConfig(route="aligned", prefix_cache_mb=16))
    result = first.generate(prompts, GREEDY)
    second = Rollout(second_model, config=RolloutConfig(route="aligned", prefix_cache_mb=16))
    again = second.generate([prompts[0] + result.tokens[0] + [3]], GREEDY)
    assert again.profile.cached_prompt_tokens == 0
    assert prefix_cache_module.PrefixCache is type(first.prefix_cache) and first.prefix_cache is not second.prefix_cache


# ------------------------------------------------------------------ invariant kernels: bitwise
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_continuation_equals_one_shot_prefill_bitwise(arch, dtype):
    """Turn 2 continued from the cache vs the same conversations prefilled whole by a Rollout without a
    cache: tokens and trainer logprobs bitwise equal, sampling with n = 3 on 4 rows (refills)."""
    model = build_tiny_model(arch, seed=ARCHS.index(arch), dtype=dtype)
    sampling = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], temperature=1.0, n=3, seed=5,
                              logprobs=True, continuous_batch_size=4)  # fmt: skip
    cached = Rollout(model, config=RolloutConfig(route="auto", kernels="invariant", prefix_cache_mb=16))
    history = _turns(cached, random_prompts([33, 12, 47], seed=20), turns=2, seed=20, sampling=sampling)
    prompts, continued = history[1]
    assert continued.profile.prefix_cache_hits == len(prompts)
    fresh = Rollout(model, config=RolloutConfig(route="aligned", kernels="invariant")).generate(prompts, sampling)
    assert continued.tokens == fresh.tokens
    assert continued.logprobs == fresh.logprobs  # float lists: bitwise


def test_negative_control_hf_kernels_continue_close_but_not_bitwise():
    """The same comparison with the model's own kernels in bf16: a continuation computes the prefix's K/V
    in decode steps and the rest in another batch shape, so its logprobs differ from a one-shot prefill's
    somewhere; the bitwise oracle above can fail."""
    model = build_tiny_model("tiny-llama", seed=0, dtype=torch.bfloat16)
    sampling = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], temperature=1.0, n=3, seed=5,
                              logprobs=True, continuous_batch_size=4)  # fmt: skip
    cached = Rollout(model, config=RolloutConfig(route="auto", prefix_cache_mb=16, kernels="torch"))
    history = _turns(cached, random_prompts([33, 12, 47], seed=20), turns=2, seed=20, sampling=sampling)
    prompts, continued = history[1]
    assert continued.profile.prefix_cache_hits == len(prompts)
    fresh = Rollout(model, config=RolloutConfig(route="aligned", kernels="torch")).generate(prompts, sampling)
    assert continued.logprobs != fresh.logprobs


# ------------------------------------------------------------------ shared prefixes inside one call
# Costs under which sharing a 100-token prefix pays (the defaults are a GPU's, where a forward's fixed
# cost dominates); the decision itself is tested in test_shared_prefix.py.
SHARING_COSTS = CostCoefficients(fixed_ms=1.0, token_ms=0.05, attention_ms=1.0, kv_ms=0.01, decode_ms=10.0)


def _system_prompt_workload(seed: int):
    """10 prompts: 8 share a 100-token system prompt (+ 2..30 own tokens), 2 share nothing."""
    system = random_prompts([100], seed=seed)[0]
    users = random_prompts([random.Random(seed).randint(2, 30) for _ in range(8)], seed=seed + 1)
    return [system + u for u in users] + random_prompts([45, 20], seed=seed + 2), len(system)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_shared_system_prompt_is_prefilled_once_and_equals_generate(tiny_models, arch):
    """With 3 cache rows the 8 members arrive over several admissions (refills): the prefix is still
    prefilled once per call, cache or not."""
    model = tiny_models(arch)
    prompts, system = _system_prompt_workload(ARCHS.index(arch) + 30)
    sampling = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], continuous_batch_size=3)
    for megabytes in (0, 16):
        config = RolloutConfig(route="bucketed", prefix_cache_mb=megabytes, costs=SHARING_COSTS)
        result = Rollout(model, config=config).generate(prompts, sampling)
        _assert_oracle(model, prompts, result)
        reused = result.profile.shared_prompt_tokens + result.profile.cached_prompt_tokens
        # The cache may serve a refill a little more than the system prompt (a chance common first token).
        assert reused == 8 * system if megabytes == 0 else reused >= 8 * system
        assert result.profile.shared_prefixes == 1


def test_share_prefixes_off_prefills_every_prompt_whole(tiny_models):
    model = tiny_models("tiny-qwen2")
    prompts, _ = _system_prompt_workload(40)
    config = RolloutConfig(route="bucketed", share_prefixes=False, costs=SHARING_COSTS)
    result = Rollout(model, config=config).generate(prompts, GREEDY)
    assert result.profile.shared_prefixes == 0 and result.profile.prefill_tokens >= sum(map(len, prompts))
    _assert_oracle(model, prompts, result)


def test_auto_shares_a_long_system_prompt_when_the_cost_model_says_it_pays(tiny_models):
    model = tiny_models("tiny-qwen2")
    system = random_prompts([512], seed=41)[0]
    prompts = [system + u for u in random_prompts([random.Random(41).randint(16, 64) for _ in range(16)], seed=42)]
    costs = CostCoefficients(fixed_ms=5.0, token_ms=0.01, attention_ms=1.0, kv_ms=0.01, decode_ms=10.0)
    result = Rollout(model, config=RolloutConfig(route="auto", costs=costs)).generate(prompts, GREEDY)
    assert result.profile.route == "bucketed" and result.profile.shared_prefixes == 1
    assert result.profile.prefill_tokens < sum(map(len, prompts)) - 8 * 512
    _assert_oracle(model, prompts, result)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_sharing_equals_whole_prefills_bitwise(dtype):
    model = build_tiny_model("tiny-qwen2", seed=3, dtype=dtype)
    prompts, _ = _system_prompt_workload(43)
    sampling = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], temperature=1.0, n=2, seed=9,
                              logprobs=True, continuous_batch_size=5)  # fmt: skip
    results = [
        Rollout(model, config=RolloutConfig(route="bucketed", kernels="invariant", share_prefixes=share,
                                            costs=SHARING_COSTS)).generate(prompts, sampling)  # fmt: skip
        for share in (True, False)
    ]
    assert results[0].profile.shared_prefixes == 1 and results[1].profile.shared_prefixes == 0
    assert results[0].tokens == results[1].tokens and results[0].logprobs == results[1].logprobs


@pytest.mark.parametrize("fused", [False, True])
def test_a_fused_optimizer_step_is_seen_although_it_does_not_bump_versions(fused):
    """Fused AdamW (TRL's default optimizer) writes parameters without bumping `_version`; the engine
    counts optimizer steps, so the next turn reuses nothing and equals generate on the new weights."""
    model = _fresh_model()
    rollout = Rollout(model, config=RolloutConfig(route="aligned", prefix_cache_mb=16))
    first = random_prompts([40, 28], seed=21)
    result = rollout.generate(first, GREEDY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused)
    versions = [p._version for p in model.parameters()]
    ids = torch.tensor([random_prompts([24], seed=22)[0]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    if fused:
        assert [p._version for p in model.parameters()] == versions  # the counters really miss it
    second = [p + t + [5, 6] for p, t in zip(first, result.tokens, strict=True)]
    continued = rollout.generate(second, GREEDY)
    assert continued.profile.cached_prompt_tokens == 0 and continued.profile.prefix_cache_invalidations == 1
    _assert_oracle(model, second, continued)
