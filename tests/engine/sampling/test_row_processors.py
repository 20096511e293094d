"""Logits processors applied per sequence on every route: the GenerationConfig options HF applies through
its processors (sequence_bias, no_repeat_ngram_size, bad_words_ids, min_length, suppress_tokens,
begin_suppress_tokens), `prefix_allowed_tokens_fn` and a caller's own `logits_processor`.

Oracle: single-request HF `generate` with the same option (each processor sees one sequence, as there).
Every case asserts that the option changes the oracle's tokens (a test where it changed nothing could not
fail), and one negative control shows HF's *batched* generate, which hands processors the left-padded
batch, differs from that oracle: applying them to the padded batch is not enough."""

from __future__ import annotations

import pytest
import torch
from oracles import hf_greedy, teacher_forced_logprobs
from transformers import LogitsProcessor, LogitsProcessorList
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.sampling.streams import request_seeds

pytestmark = pytest.mark.engine

MAX_NEW = 16
LENGTHS = (5, 17, 2, 30, 9, 23)
ROUTES = ("ordinary", "equal_width", "aligned", "bucketed", "auto")


class BanTheLeader(LogitsProcessor):
    """A caller's processor (in place, as some are): at even lengths the best token is banned."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] % 2 == 0:
            scores[torch.arange(scores.shape[0]), scores.argmax(-1)] = float("-inf")
        return scores


def odd_or_even(batch_id: int, ids: torch.Tensor) -> list[int]:
    """prefix_allowed_tokens_fn: odd ids after an odd length, even ids after an even one."""
    return list(range(len(ids) % 2, 1024, 2))


def option_cases(free: list[list[int]]) -> dict[str, dict]:
    """Each option with values taken from the unconstrained greedy tokens, so that it bites."""
    return {
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 1},
        "bad_words_ids": {"bad_words_ids": [[free[1][0]], [free[2][0], free[2][1]]]},
        "suppress_tokens": {"suppress_tokens": [free[3][0], free[4][1]]},
        "begin_suppress_tokens": {"begin_suppress_tokens": [free[0][0], free[5][0]]},
        "sequence_bias": {"sequence_bias": [[[free[1][1]], -5.0], [[free[2][0], free[2][1]], 3.0]]},
        "logits_processor": {"logits_processor": LogitsProcessorList([BanTheLeader()])},
        "prefix_allowed_tokens_fn": {"prefix_allowed_tokens_fn": odd_or_even},
    }


def sampling(**fields) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=[], continuous_batch_size=4, **fields)


@pytest.mark.parametrize("option", ["no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
                                    "sequence_bias", "logits_processor", "prefix_allowed_tokens_fn"])  # fmt: skip
@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gpt2"])
def test_each_option_gives_single_request_generates_tokens_on_every_route(tiny_models, model_name, option):
    model = tiny_models(model_name)
    prompts = random_prompts(LENGTHS, seed=3)
    free = hf_greedy(model, prompts, MAX_NEW)
    options = option_cases(free)[option]
    expected = hf_greedy(model, prompts, MAX_NEW, **options)
    assert expected != free, f"{option} must change some completion, else this test could not fail"
    for route in ROUTES:
        for kernels in ("hf", "invariant") if model_name == "tiny-llama" else ("hf",):
            rollout = Rollout(model, config=RolloutConfig(route=route, kernels=kernels))
            assert rollout.generate(prompts, sampling(), **options).tokens == expected, (route, kernels)


def through_eos(model, prompts: list[list[int]], eos: int, **options) -> list[list[int]]:
    """HF greedy `generate` of `prompts` as one left-padded batch: each row's new tokens through its EOS."""
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(p[::-1]) for p in prompts], batch_first=True).flip(-1)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(p), dtype=torch.long) for p in prompts], batch_first=True).flip(-1)
    with torch.inference_mode():
        output = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                                eos_token_id=eos, **options)[:, ids.shape[1] :].tolist()  # fmt: skip
    return [row[: row.index(eos) + 1] if eos in row else row for row in output]


@pytest.mark.filterwarnings("ignore:Unfeasible length constraints")  # the oracle's short prompts, HF's own note
@pytest.mark.parametrize("route", ["ordinary", "aligned", "bucketed"])
def test_min_length_counts_each_sequences_own_length_where_hfs_batch_counts_its_padding(tiny_models, route):
    """min_length = prompt + new tokens, per sequence (single-request generate). The negative control: HF's
    batched generate counts the left-padded width, so its short prompts may end early: it differs."""
    model = tiny_models("tiny-llama")
    prompts = random_prompts(LENGTHS, seed=3)
    free = hf_greedy(model, prompts, MAX_NEW)
    eos = next(t for t in sorted({t for row in free for t in row[:4]}) if sum(t in row[:4] for row in free) >= 2)
    minimum = max(map(len, prompts)) + 2  # past every prompt's own length, below the padded batch's + 3
    expected = [through_eos(model, [p], eos, min_length=minimum)[0] for p in prompts]
    assert expected != [through_eos(model, [p], eos)[0] for p in prompts], "min_length must change some completion"
    batched = through_eos(model, prompts, eos, min_length=minimum)
    assert batched != expected, "HF's batched generate must read the padding (the control), else this test could not fail"
    result = Rollout(model, config=RolloutConfig(route=route)).generate(
        prompts, SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=eos, continuous_batch_size=4), min_length=minimum
    )
    assert result.tokens == expected


def test_sampled_requests_with_processors_do_not_depend_on_their_batch(tiny_models):
    """Sampled, n = 2, refill, invariant kernels: banned tokens never appear; each request equals itself
    alone (tokens and logprobs, bitwise); trainer-mode logprobs are a teacher-forced forward's (an in-place
    processor writes the engine's copy, never the raw logits); processed-mode logprobs are finite."""
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(LENGTHS, seed=4)
    seeds = list(request_seeds(9, len(prompts)))
    banned = list(range(0, 1024, 3))
    options = {"suppress_tokens": banned, "logits_processor": [BanTheLeader()], "no_repeat_ngram_size": 2}
    common = {"max_new_tokens": MAX_NEW, "temperature": 1.0, "n": 2, "logprobs": True, "eos_token_id": []}
    rollout = Rollout(model, config=RolloutConfig(route="auto", kernels="invariant"))
    batch = rollout.generate(prompts, SamplingConfig(seed=seeds, continuous_batch_size=5, **common), **options)
    assert not {t for samples in batch.tokens for tokens in samples for t in tokens} & set(banned)
    for i, prompt in enumerate(prompts):
        alone = rollout.generate([prompt], SamplingConfig(seed=[seeds[i]], **common), **options)
        assert (batch.tokens[i], batch.logprobs[i]) == (alone.tokens[0], alone.logprobs[0]), f"prompt {i}"
    tokens, logprobs = batch.tokens[0][1], batch.logprobs[0][1]
    forced = teacher_forced_logprobs(model, prompts[0], tokens)
    torch.testing.assert_close(torch.tensor(logprobs), forced, rtol=0, atol=1e-5)
    processed = rollout.generate(prompts, SamplingConfig(seed=seeds, logprobs_mode="processed", **common), **options)
    assert processed.tokens == batch.tokens
    assert all(torch.isfinite(torch.tensor(lp)).all() for samples in processed.logprobs for lp in samples)
    assert processed.logprobs != batch.logprobs  # the masks reshape the distribution sampled from


def test_a_processor_sees_one_sequence_its_prompt_and_its_own_tokens(tiny_models):
    """What a caller's (possibly stateful) processor is handed: one sequence, [1, prompt + generated]."""
    model = tiny_models("tiny-llama")
    prompts = random_prompts(LENGTHS, seed=3)
    seen: list[list[int]] = []

    def record(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        assert input_ids.shape[0] == scores.shape[0] == 1
        seen.append(input_ids[0].tolist())
        return scores

    result = Rollout(model, config=RolloutConfig(route="bucketed")).generate(prompts, sampling(n=2), logits_processor=record)
    expected = sorted([*p, *tokens[:step]] for p, samples in zip(prompts, result.tokens, strict=True)
                      for tokens in samples for step in range(len(tokens)))  # fmt: skip
    assert sorted(seen) == expected


def test_the_models_own_options_apply_as_in_generate(tiny_models, monkeypatch):
    model = tiny_models("tiny-llama")
    prompts = random_prompts(LENGTHS, seed=3)
    free = hf_greedy(model, prompts, MAX_NEW)
    banned = [free[3][0], free[4][1]]
    with monkeypatch.context() as patch:
        patch.setattr(model.generation_config, "suppress_tokens", banned)
        expected = hf_greedy(model, prompts, MAX_NEW)
        result = Rollout(model, config=RolloutConfig(route="aligned")).generate(prompts, sampling())
        off = Rollout(model, config=RolloutConfig(route="aligned")).generate(prompts, sampling(), suppress_tokens=None)
    assert result.tokens == expected != free
    assert off.tokens == free


def test_bad_input_is_refused_by_name_and_the_rollout_stays_usable(tiny_models):
    model = tiny_models("tiny-llama")
    prompts = random_prompts(LENGTHS, seed=3)
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    refused = {
        "bad_words_ids": [[5], [2000]],
        "suppress_tokens": [-1],
        "begin_suppress_tokens": [1024],
        "sequence_bias": [[[4000], 1.0]],
    }
    for option, value in refused.items():
        with pytest.raises(ValueError, match=rf"{option} holds .*not a token id of this model"):
            rollout.generate(prompts, sampling(), **{option: value})
    with pytest.raises(ValueError, match=r"logits_processor\[1\]=3 is not callable"):
        rollout.generate(prompts, sampling(), logits_processor=[BanTheLeader(), 3])
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn=.* is not callable"):
        rollout.generate(prompts, sampling(), prefix_allowed_tokens_fn=[1, 2])
    with pytest.raises(ValueError, match=r"returned \(1, 3\) for one sequence's scores"):
        rollout.generate(prompts, sampling(), logits_processor=lambda ids, scores: scores[:, :3])

    class Broken(LogitsProcessor):
        def __call__(self, input_ids, scores):
            raise KeyError("the caller's own error")

    with pytest.raises(KeyError, match="the caller's own error"):  # propagated unchanged
        rollout.generate(prompts, sampling(), logits_processor=[Broken()])
    assert rollout.generate(prompts, sampling()).tokens == hf_greedy(model, prompts, MAX_NEW)
