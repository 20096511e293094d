"""The repetition penalty and per-sequence logits processors in the asynchronous engine, with requests
joining and leaving the batch around them.

Oracles: greedy requests equal single-request HF `generate` with the same option (HF's own processors on
that one sequence); sampled ones (`kernels="invariant"`) equal `Rollout.generate` of that prompt, bitwise
in tokens and logprobs. A request resumed with its first tokens continues the oracle exactly. Every option
must change the oracle's tokens (else the test could not fail), and the negative control hands the
penalty and processors the request's prompt alone, without the tokens made so far, and must fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from oracles import hf_greedy
from transformers import LogitsProcessor
from workloads import random_prompts

from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.engine.rollout import Rollout
from autobucket.serving import AsyncEngine, token_choice

pytestmark = pytest.mark.usefixtures("single_thread")

WAIT_S = 120
MAX_NEW = 14
RESUMED_AT = 5  # the resumed copy of each request is submitted with its oracle's first tokens
INVARIANT = RolloutConfig(kernels="invariant", route="aligned")
PROMPTS = random_prompts([5, 17, 2, 11, 9, 23, 7], seed=3)


class BanTheLeader(LogitsProcessor):
    """A caller's processor (in place, as some are): at even lengths the best token is banned."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] % 2 == 0:
            scores[torch.arange(scores.shape[0]), scores.argmax(-1)] = float("-inf")
        return scores


def odd_or_even(batch_id: int, ids: torch.Tensor) -> list[int]:
    """prefix_allowed_tokens_fn: odd ids after an odd length, even ids after an even one (batch 0 only:
    a request is prompt 0 of a call of its own)."""
    assert batch_id == 0
    return list(range(len(ids) % 2, 1024, 2))


def option_cases(free: list[list[int]]) -> list[dict]:
    """One option per prompt (the last prompt: none), with values taken from its unconstrained greedy
    tokens so that each bites."""
    return [
        {"logits_processor": [BanTheLeader()]},
        {"bad_words_ids": [[free[1][0]], [free[1][1], free[1][2]]]},
        {"repetition_penalty": 1.5},
        {"sequence_bias": [[[free[3][1]], -5.0], [[free[3][2], free[3][3]], 3.0]]},
        {"no_repeat_ngram_size": 1},
        {"prefix_allowed_tokens_fn": odd_or_even},
        {},
    ]


def split(options: dict) -> tuple[dict, dict]:
    """(SamplingConfig fields, generate overrides) of one option set."""
    fields = {k: v for k, v in options.items() if k == "repetition_penalty"}
    return fields, {k: v for k, v in options.items() if k not in fields}


def greedy_engine_run(model) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Every prompt's request under its option, all in flight at once with unconstrained ones, and a
    resumed copy of each; returns (expected, whole results, resumed results)."""
    free = hf_greedy(model, PROMPTS, MAX_NEW)
    cases = option_cases(free)
    expected = [hf_greedy(model, [p], MAX_NEW, **c)[0] for p, c in zip(PROMPTS, cases, strict=True)]
    for index, (tokens, case) in enumerate(zip(expected, cases, strict=True)):
        assert case == {} or tokens != free[index], f"option {case} must change prompt {index}'s tokens"
    with AsyncEngine(model, max_batch=5, max_model_len=64) as engine:
        handles, resumed = [], []
        for prompt, case, tokens in zip(PROMPTS, cases, expected, strict=True):
            fields, overrides = split(case)
            budget = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=[], **fields)
            engine.submit(prompt, dataclasses.replace(budget, max_new_tokens=3), **overrides)  # leaves early
            handles.append(engine.submit(prompt, budget, **overrides))
            rest = dataclasses.replace(budget, max_new_tokens=MAX_NEW - RESUMED_AT)
            resumed.append(engine.submit(prompt, rest, generated=tokens[:RESUMED_AT], **overrides))
        whole = [h.result(timeout=WAIT_S).tokens for h in handles]
        later = [h.result(timeout=WAIT_S).tokens for h in resumed]
    return expected, whole, later


def test_penalty_and_processors_give_single_request_generates_tokens(tiny_models):
    expected, whole, resumed = greedy_engine_run(tiny_models("tiny-llama"))
    for index, (tokens, got, rest) in enumerate(zip(expected, whole, resumed, strict=True)):
        assert got == tokens, f"prompt {index}"
        assert rest == tokens[RESUMED_AT:], f"prompt {index} resumed"


def test_control_processors_without_the_tokens_so_far_fail_the_oracle(tiny_models, monkeypatch):
    monkeypatch.setattr(token_choice, "row_history", lambda request: list(request.prompt_ids))
    expected, whole, resumed = greedy_engine_run(tiny_models("tiny-llama"))
    assert whole[2] != expected[2] or resumed[2] != expected[2][RESUMED_AT:]  # the penalty
    assert whole[4] != expected[4] or resumed[4] != expected[4][RESUMED_AT:]  # no_repeat_ngram_size


def test_sampled_requests_with_penalty_and_processors_are_rollout_generates(tiny_models):
    model = tiny_models("tiny-llama")
    base = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=[], temperature=1.0, top_k=50, seed=7, logprobs=True)
    cases = option_cases(hf_greedy(model, PROMPTS, MAX_NEW))
    rollout = Rollout(model, config=INVARIANT)
    with AsyncEngine(model, config=INVARIANT, max_batch=6, max_model_len=64) as engine:
        submitted = []
        for prompt, case in zip(PROMPTS, cases, strict=True):
            fields, overrides = split(case)
            config = dataclasses.replace(base, **fields)
            handles = [engine.submit(prompt, config, sample=i, **overrides) for i in range(2)]
            plain = engine.submit(prompt, base, sample=1)
            submitted.append((prompt, config, overrides, handles, plain))
        bites = 0
        for prompt, config, overrides, handles, plain in submitted:
            outputs = [handle.result(timeout=WAIT_S) for handle in handles]
            reference = rollout.generate([prompt], dataclasses.replace(config, n=2), **overrides)
            assert [o.tokens for o in outputs] == reference.tokens[0], f"{overrides or config}"
            assert [o.logprobs for o in outputs] == reference.logprobs[0], f"{overrides or config}"
            bites += outputs[1].tokens != plain.result(timeout=WAIT_S).tokens
    assert bites >= 3  # the options change sampled tokens too: the oracle could fail


def test_bad_overrides_name_the_option_and_leave_the_engine_serving(tiny_models):
    model = tiny_models("tiny-qwen2")
    prompt = PROMPTS[0]
    greedy = SamplingConfig(max_new_tokens=6, eos_token_id=[])
    with AsyncEngine(model, max_batch=2, max_model_len=64) as engine:
        with pytest.raises(ValueError, match="logits_processor"):
            engine.submit(prompt, greedy, logits_processor=[42])
        with pytest.raises(ValueError, match="no_such_option"):
            engine.submit(prompt, greedy, no_such_option=1)
        with pytest.raises(ValueError, match="bad_words_ids"):
            engine.submit(prompt, greedy, bad_words_ids=[[5000]])
        output = engine.submit(prompt, greedy).result(timeout=WAIT_S)
        assert not engine._pending
    assert output.tokens == hf_greedy(model, [prompt], 6)[0]
