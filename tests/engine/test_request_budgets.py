"""Per-request budgets: `SamplingConfig(max_new_tokens=[...])`, one per prompt.

Oracles: single-request HF greedy `generate` with each prompt's own `max_new_tokens`; and, for sampled
requests under `kernels="invariant"`, the same request run alone with its budget (bitwise tokens and
logprobs: a request's output must not depend on the other requests' budgets). A route that used the largest
budget for every request, or one request's budget for its batch, returns other lengths and fails them."""

from __future__ import annotations

import random

import pytest
from oracles import oracle_generate
from workloads import ARCHS, VOCAB, random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.sampling.streams import subset_sampling
from autobucket.tools.generate_job import generate_in_chunks

pytestmark = pytest.mark.engine

LENGTHS = (5, 17, 2, 30, 9, 23)
BUDGETS = [3, 12, 7, 1, 20, 5]  # the longest prompt has the smallest budget: the cache must hold 30 + 20
ROUTE_CASES = ("ordinary", "equal_width", "aligned", "bucketed", "auto")


def oracle(model, prompts, budgets, eos_token_id=None):
    pairs = [oracle_generate(model, p, b, eos_token_id=eos_token_id) for p, b in zip(prompts, budgets, strict=True)]
    return [t for t, _ in pairs], [r for _, r in pairs]


@pytest.mark.parametrize("route", ROUTE_CASES)
@pytest.mark.parametrize("model_name", ARCHS)
def test_each_request_generates_its_own_budget_as_hf_generate_does(tiny_models, model_name, route):
    model = tiny_models(model_name)
    prompts = random_prompts(LENGTHS, seed=3)
    # continuous_batch_size 3: two refills on the CB routes, two batches on the ordinary route
    sampling = SamplingConfig(max_new_tokens=BUDGETS, eos_token_id=[], continuous_batch_size=3)
    result = Rollout(model, config=RolloutConfig(route=route)).generate(prompts, sampling)
    tokens, reasons = oracle(model, prompts, BUDGETS, eos_token_id=[])
    assert result.tokens == tokens
    assert result.finish_reasons == reasons == ["length"] * len(prompts)
    assert [len(t) for t in result.tokens] == BUDGETS


def test_eos_ends_a_request_before_its_budget(tiny_models):
    """With the model's EOS set to a token greedy emits early for some prompts, those end by "eos" and the
    rest at their own budgets."""
    model = tiny_models("tiny-llama")
    prompts = random_prompts(LENGTHS, seed=3)
    free, _ = oracle(model, prompts, [max(BUDGETS)] * len(prompts), eos_token_id=[])
    eos = free[1][2]  # prompt 1's third token: it ends there (budget 12), whatever the others do
    sampling = SamplingConfig(max_new_tokens=BUDGETS, eos_token_id=eos, continuous_batch_size=3)
    for route in ("ordinary", "aligned"):
        result = Rollout(model, config=RolloutConfig(route=route)).generate(prompts, sampling)
        tokens, reasons = oracle(model, prompts, BUDGETS, eos_token_id=eos)
        assert (result.tokens, result.finish_reasons) == (tokens, reasons), route
        assert "eos" in reasons and "length" in reasons


def test_the_ordinary_route_stops_each_batch_at_its_own_largest_budget(tiny_models):
    """HF `generate` runs one max_new_tokens per batch: each batch's largest budget, and a per-row stopping
    criterion ends the batch once every row has its budget. Rows are batched largest budget first: budgets
    20, 12, 7 then 5, 3, 1 take 19 + 4 decode steps (in input order 11 + 19; one budget for all 2 x 19)."""
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(LENGTHS, seed=3)
    sampling = SamplingConfig(max_new_tokens=BUDGETS, eos_token_id=[], continuous_batch_size=3)
    profile = Rollout(model, config=RolloutConfig(route="ordinary")).generate(prompts, sampling).profile
    ordered = sorted(BUDGETS, reverse=True)
    assert profile.decode_forwards == (ordered[0] - 1) + (ordered[3] - 1) == 23


@pytest.mark.parametrize("route", ["equal_width", "aligned", "auto"])
def test_the_largest_budget_is_admitted_first_so_no_request_decodes_alone_at_the_end(tiny_models, route):
    """Six short requests and one long one, last in the input, on three rows: admitted in input order, the
    long one would start after the short ones and decode alone (2 + 2 + 19 steps and more); admitted first,
    the short ones refill the other two rows meanwhile and the call takes the long one's 19 decode steps."""
    model = tiny_models("tiny-llama")
    prompts = random_prompts((4, 9, 3, 12, 6, 5, 8), seed=2)
    budgets = [3, 3, 3, 3, 3, 3, 20]
    sampling = SamplingConfig(max_new_tokens=budgets, eos_token_id=[], continuous_batch_size=3)
    result = Rollout(model, config=RolloutConfig(route=route)).generate(prompts, sampling)
    assert result.tokens == oracle(model, prompts, budgets, eos_token_id=[])[0]
    assert result.profile.decode_forwards == max(budgets) - 1


@pytest.mark.parametrize("route", ["aligned", "auto"])
def test_sampled_requests_do_not_depend_on_the_other_budgets(tiny_models, route):
    """Invariant kernels: each sampled request (n = 2, refill, per-prompt seeds) gets bitwise the tokens and
    logprobs it gets alone with its budget; with a larger budget its output only grows (same prefix)."""
    model = tiny_models("tiny-qwen3")
    prompts = random_prompts(LENGTHS, seed=5)
    seeds = [101 + i for i in range(len(prompts))]
    common = {"temperature": 0.9, "top_p": 0.95, "n": 2, "logprobs": True, "eos_token_id": []}
    rollout = Rollout(model, config=RolloutConfig(route=route, kernels="invariant"))
    together = rollout.generate(prompts, SamplingConfig(max_new_tokens=BUDGETS, seed=seeds, continuous_batch_size=4, **common))
    longest = rollout.generate(prompts, SamplingConfig(max_new_tokens=max(BUDGETS), seed=seeds, **common))
    for i, prompt in enumerate(prompts):
        alone = rollout.generate([prompt], SamplingConfig(max_new_tokens=BUDGETS[i], seed=[seeds[i]], **common))
        assert together.tokens[i] == alone.tokens[0], f"prompt {i}"
        assert together.logprobs[i] == alone.logprobs[0], f"prompt {i}"
        assert [len(t) for t in together.tokens[i]] == [BUDGETS[i]] * 2
        assert [t[: BUDGETS[i]] for t in longest.tokens[i]] == together.tokens[i]
    assert together.tokens[0][0] != together.tokens[0][1]  # two samples, not one repeated


def test_each_turn_continues_from_the_prefix_cache_with_its_own_budget(tiny_models):
    """Agent turns with different budgets left: each conversation's turn equals HF generate over the whole
    conversation with its budget, and the second turn reads the first turn's K/V from the cache."""
    model = tiny_models("tiny-mistral")
    rollout = Rollout(model, config=RolloutConfig(route="aligned", prefix_cache_mb=16))
    rng = random.Random(8)
    conversations = random_prompts((20, 33, 18), seed=8)
    for turn, budgets in enumerate(([9, 2, 14], [4, 11, 1])):
        result = rollout.generate(conversations, SamplingConfig(max_new_tokens=budgets, eos_token_id=[]))
        assert result.tokens == oracle(model, conversations, budgets, eos_token_id=[])[0], f"turn {turn}"
        if turn:
            assert result.profile.cached_prompt_tokens > 0
        tools = [[rng.randrange(3, VOCAB) for _ in range(5)] for _ in conversations]
        conversations = [c + t + x for c, t, x in zip(conversations, result.tokens, tools, strict=True)]


def test_the_context_check_uses_each_prompts_own_budget(tiny_models):
    """A prompt near the end of the context fits with a small budget of its own (one int for all would not);
    a prompt whose own budget passes the context is named."""
    model = tiny_models("tiny-qwen2")
    limit = model.config.max_position_embeddings
    prompts = [random_prompts([limit - 4], seed=1)[0], random_prompts([7], seed=2)[0]]
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    result = rollout.generate(prompts, SamplingConfig(max_new_tokens=[4, 16], eos_token_id=[]))
    assert [len(t) for t in result.tokens] == [4, 16]
    with pytest.raises(ValueError, match=rf"prompt 0 has {limit - 4} tokens; with max_new_tokens=16"):
        rollout.generate(prompts, SamplingConfig(max_new_tokens=16, eos_token_id=[]))
    with pytest.raises(ValueError, match=rf"prompt 0 has {limit - 4} tokens; with max_new_tokens=5"):
        rollout.generate(prompts, SamplingConfig(max_new_tokens=[5, 16], eos_token_id=[]))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([4, 0], r"max_new_tokens=\[4, 0\] is invalid: pass an int >= 1 or a list of them, one per prompt"),
        ([4, -2], r"max_new_tokens=\[4, -2\] is invalid"),
        ([4, 2.5], r"max_new_tokens=\[4, 2.5\] is invalid"),
        ([True, 3], r"max_new_tokens=\[True, 3\] is invalid"),
        ("8", r"max_new_tokens='8' is invalid"),
    ],
)
def test_bad_budgets_are_refused_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(max_new_tokens=value)


def test_a_budget_list_of_the_wrong_length_is_refused_and_the_rollout_goes_on(tiny_models):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts((5, 9, 3), seed=1)
    rollout = Rollout(model, config=RolloutConfig(route="auto", cache_capacity=None))
    with pytest.raises(ValueError, match="max_new_tokens has 2 values for 3 prompts: pass one per prompt or one int"):
        rollout.generate(prompts, SamplingConfig(max_new_tokens=[4, 5]))
    result = rollout.generate(prompts, SamplingConfig(max_new_tokens=[4, 5, 6], eos_token_id=[]))
    assert [len(t) for t in result.tokens] == [4, 5, 6]
    assert rollout.generate([], SamplingConfig(max_new_tokens=[])).tokens == []


def test_an_explicit_cache_capacity_must_hold_the_longest_prompt_and_the_largest_budget(tiny_models):
    """A wide admission moves the shared write front for every row, so the bound is the longest prompt plus
    the largest budget even when they belong to different prompts (here 30 + 20 - 1 = 49 columns)."""
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(LENGTHS, seed=3)
    sampling = SamplingConfig(max_new_tokens=BUDGETS, eos_token_id=[], continuous_batch_size=3)
    with pytest.raises(ValueError, match="prompt 3 has 30 tokens and the largest max_new_tokens is 20, which needs 49"):
        Rollout(model, config=RolloutConfig(route="aligned", cache_capacity=48)).generate(prompts, sampling)
    result = Rollout(model, config=RolloutConfig(route="aligned", cache_capacity=49)).generate(prompts, sampling)
    assert result.tokens == oracle(model, prompts, BUDGETS, eos_token_id=[])[0]


def test_chunks_and_shards_keep_each_prompts_budget_and_stream(tiny_models):
    """`subset_sampling` gives a chunk (the CLI's generate job) or a shard (RayRollout) each prompt's budget and
    stream key of the whole call, so chunked generation equals one call."""
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(LENGTHS, seed=6)
    sampling = SamplingConfig(max_new_tokens=BUDGETS, temperature=1.0, seed=3, eos_token_id=[])
    rollout = Rollout(model, config=RolloutConfig(route="aligned", kernels="invariant"))
    whole = rollout.generate(prompts, sampling)
    chunks = generate_in_chunks(rollout, prompts, sampling, chunk=4)
    assert [t for chunk in chunks for t in chunk.tokens] == whole.tokens
    shard = subset_sampling(sampling, [4, 1], len(prompts))
    assert (shard.max_new_tokens, shard.seed[1]) == ([20, 12], subset_sampling(sampling, [1], 6).seed[0])
    assert rollout.generate([prompts[4], prompts[1]], shard).tokens == [whole.tokens[4], whole.tokens[1]]
