"""Cascade decode: the n samples of a prompt read one shared copy of its K/V
(`engine/kernels/shared_prefix_attention.py`), against the same call with per-row copies and against
single-request HF `generate`; a negative control that points rows at the wrong prompt must break it.

Cascade decode is an eager-step feature (the compiled step keeps per-row copies), so every Rollout here
pins compile=False: under `make test-compile` these tests still test the cascade, not its absence."""

from __future__ import annotations

import pytest
import torch
from oracles import oracle_generate
from workloads import ARCHS, random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine import routes
from autobucket.engine.batching.static_cache import StaticKVCache
from autobucket.engine.kernels import shared_prefix_attention

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_thread")]

BUDGET = 8
SAMPLING = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], n=3, temperature=1.0, seed=4, logprobs=True,
                          continuous_batch_size=5)  # 15 rows on 5: samples of a prompt split over admissions  # fmt: skip


def _without_sharing(monkeypatch):
    monkeypatch.setattr(routes, "_shared_prefix_allowed", lambda call: False)


def _flat(logprobs):
    return [value for samples in logprobs for sample in samples for value in sample]


@pytest.mark.parametrize("decode", ["engine kernel", "flash parts", "math parts"])
@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prompt_kv_equals_per_row_copies(tiny_models, arch, decode, always_share, monkeypatch):
    """The default kernels decode on the engine's kernel, which reads the shared copy as the first keys
    of each row's sequence (bitwise the per-row copies); where it cannot take the call (no compiler, a
    GPU) the shared part and the row's own run as two attention calls merged by logsumexp: SDPA's flash
    kernel on a CPU, fp32 math elsewhere ("math parts": that form, run on the CPU). The bitwise case
    prefills each prompt alone (aligned): the default kernels' prefill is not batch-invariant, and
    bucketed plans follow the costs learned online, which earlier calls move."""
    route = "aligned" if decode == "engine kernel" else "bucketed"
    if decode != "engine kernel":
        monkeypatch.setattr(routes, "_decode_attention", lambda call: None)
    if decode == "math parts":
        monkeypatch.setattr(shared_prefix_attention, "_MATH_PARTS", True)
    model = tiny_models(arch)
    prompts = random_prompts([40, 70, 12, 90, 35], seed=ARCHS.index(arch) + 50)
    # the engine's decode kernel is asked for; "torch" otherwise runs transformers' SDPA there
    asked = {"decode_attention": "cpu"} if decode == "engine kernel" else None
    config = RolloutConfig(route=route, compile=False, op_backends=asked)
    shared = Rollout(model, config=config).generate(prompts, SAMPLING)
    assert shared.profile.shared_kv_rows > 0
    _without_sharing(monkeypatch)
    copies = Rollout(model, config=config).generate(prompts, SAMPLING)
    assert copies.profile.shared_kv_rows == 0
    assert shared.tokens == copies.tokens
    difference = max(abs(a - b) for a, b in zip(_flat(shared.logprobs), _flat(copies.logprobs), strict=True))
    if decode == "engine kernel":
        assert difference == 0.0
    else:
        assert difference < 1e-4  # the merge of two softmax parts rounds differently, nothing more


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gpt2"])
def test_greedy_samples_on_a_shared_prompt_equal_generate(tiny_models, arch, always_share):
    model = tiny_models(arch)
    prompts = random_prompts([33, 64, 20], seed=60)
    sampling = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], n=2, greedy_copies=True, continuous_batch_size=4)
    result = Rollout(model, config=RolloutConfig(route="aligned", compile=False)).generate(prompts, sampling)
    assert result.profile.shared_kv_rows > 0
    for prompt, samples in zip(prompts, result.tokens, strict=True):
        expected, _ = oracle_generate(model, prompt, BUDGET, eos_token_id=[])
        assert samples == [expected, expected]


def test_negative_control_rows_reading_another_prompt_break_the_oracle(tiny_models, always_share, monkeypatch):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([40, 70, 55], seed=61)
    sampling = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], n=2, greedy_copies=True, continuous_batch_size=6)
    build = StaticKVCache._build_layout

    def swapped(self):
        layout = build(self)
        grouped = layout.row_group >= 0
        layout.row_group[grouped] = (layout.row_group[grouped] + 1) % (int(layout.row_group.max()) + 1)
        return layout

    monkeypatch.setattr(StaticKVCache, "_build_layout", swapped)
    result = Rollout(model, config=RolloutConfig(route="aligned", compile=False)).generate(prompts, sampling)
    expected = [[oracle_generate(model, p, BUDGET, eos_token_id=[])[0]] * 2 for p in prompts]
    assert result.profile.shared_kv_rows > 0 and result.tokens != expected


def test_shared_rows_feed_the_prefix_cache_whole(tiny_models, always_share):
    """A finished sample's sequence enters the prefix cache with its shared prompt in front: the next turn
    continues it and equals generate over the whole conversation."""
    model = tiny_models("tiny-mistral")
    rollout = Rollout(model, config=RolloutConfig(route="aligned", prefix_cache_mb=16, compile=False))
    prompts = random_prompts([50, 37], seed=62)
    sampling = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], n=2, greedy_copies=True)
    first = rollout.generate(prompts, sampling)
    assert first.profile.shared_kv_rows == 4
    second_prompts = [p + samples[1] + [7, 8, 9] for p, samples in zip(prompts, first.tokens, strict=True)]
    second = rollout.generate(second_prompts, SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[]))
    assert second.profile.cached_prompt_tokens == sum(len(p) + BUDGET - 1 for p in prompts)
    for prompt, tokens in zip(second_prompts, second.tokens, strict=True):
        assert tokens == oracle_generate(model, prompt, BUDGET, eos_token_id=[])[0]


def test_no_sharing_with_eager_attention_or_one_sample(tiny_models, always_share):
    prompts = random_prompts([40, 45], seed=63)
    sampling = SamplingConfig(max_new_tokens=4, eos_token_id=[], n=2, greedy_copies=True)
    eager_model = tiny_models("tiny-qwen2", attn_implementation="eager")
    eager = Rollout(eager_model, config=RolloutConfig(route="aligned", compile=False))
    assert eager.generate(prompts, sampling).profile.shared_kv_rows == 0
    single = Rollout(tiny_models("tiny-qwen2"), config=RolloutConfig(route="aligned", compile=False))
    assert single.generate(prompts, SamplingConfig(max_new_tokens=4, eos_token_id=[])).profile.shared_kv_rows == 0


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_kernels_share_bitwise(arch, dtype, always_share, monkeypatch):
    """Under kernels="invariant" a row walks [shared prompt keys | own keys] as one sequence in the
    kernel's blocks: tokens and logprobs bitwise those of per-row copies, for a prompt's samples and for a
    shared system prompt's members."""
    from autobucket import CostCoefficients
    from autobucket.models import build_tiny_model

    model = build_tiny_model(arch, seed=7, dtype=dtype)
    system = random_prompts([90], seed=68)[0]
    prompts = [system + user for user in random_prompts([4, 19, 11], seed=69)] + random_prompts([50, 33], seed=70)
    costs = CostCoefficients(fixed_ms=1.0, token_ms=0.05, attention_ms=1.0, kv_ms=0.01, decode_ms=10.0)
    config = RolloutConfig(route="bucketed", kernels="invariant", costs=costs, compile=False)
    sampling = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], n=3, temperature=1.0, seed=2, logprobs=True,
                              continuous_batch_size=7)  # fmt: skip
    shared = Rollout(model, config=config).generate(prompts, sampling)
    assert shared.profile.shared_kv_rows > 0
    _without_sharing(monkeypatch)
    copies = Rollout(model, config=config).generate(prompts, sampling)
    assert copies.profile.shared_kv_rows == 0
    assert shared.tokens == copies.tokens and shared.logprobs == copies.logprobs


def test_sharing_starts_only_when_the_copies_it_saves_are_large(tiny_models):
    model = tiny_models("tiny-qwen2")
    sampling = SamplingConfig(max_new_tokens=2, eos_token_id=[], n=4, greedy_copies=True)
    rollout = Rollout(model, config=RolloutConfig(route="aligned", compile=False))
    short = rollout.generate(random_prompts([40, 30], seed=64), sampling)  # 3 x 70 columns saved
    assert short.profile.shared_kv_rows == 0
    long = rollout.generate(random_prompts([800, 700], seed=65), sampling)  # 3 x 1500
    assert long.profile.shared_kv_rows == 8


@pytest.mark.parametrize("arch", ["tiny-qwen2", "tiny-opt"])
def test_members_of_a_shared_system_prompt_read_its_one_copy(tiny_models, arch, always_share, monkeypatch):
    """A prefix shared inside the call (prefilled once) is also read once per decode step: the members'
    rows hold only their own tokens. Greedy tokens equal generate; sampled ones equal per-row copies."""
    from autobucket import CostCoefficients

    model = tiny_models(arch)
    system = random_prompts([120], seed=66)[0]
    prompts = [system + user for user in random_prompts([5, 17, 30, 9, 22, 11], seed=67)]
    costs = CostCoefficients(fixed_ms=1.0, token_ms=0.05, attention_ms=1.0, kv_ms=0.01, decode_ms=10.0)
    config = RolloutConfig(route="bucketed", costs=costs, compile=False)
    greedy = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], continuous_batch_size=4)  # refills too
    result = Rollout(model, config=config).generate(prompts, greedy)
    assert result.profile.shared_prefixes == 1 and result.profile.shared_kv_rows == len(prompts)
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        assert tokens == oracle_generate(model, prompt, BUDGET, eos_token_id=[])[0]
    sampling = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], temperature=1.0, seed=3, logprobs=True)
    shared = Rollout(model, config=config).generate(prompts, sampling)
    _without_sharing(monkeypatch)
    copies = Rollout(model, config=config).generate(prompts, sampling)
    assert copies.profile.shared_kv_rows == 0 and shared.tokens == copies.tokens
    difference = max(abs(a - b) for x, y in zip(shared.logprobs, copies.logprobs, strict=True) for a, b in zip(x, y, strict=True))
    assert difference < 1e-4
