"""Weight updates with requests in flight: pause, an optimizer step, resume.

Oracles: the tokens sampled before the pause are single-request `generate`'s on the old weights; the
tokens after it are a fresh engine's on the new weights, given each request's tokens so far (its K/V
recomputed, nothing of the old weights reused). The negative control keeps the pre-update K/V and must
fail the second oracle."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from oracles import oracle_generate
from workloads import random_prompts

from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.serving import AsyncEngine, running_batch

pytestmark = pytest.mark.usefixtures("single_thread")

WAIT_S = 120
BUDGET = 40
PROMPTS = random_prompts([7, 15, 10, 4, 12], seed=11)
CASES = {
    "greedy-hf": (RolloutConfig(), SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[])),
    "sampled-invariant": (
        RolloutConfig(kernels="invariant"),
        SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], temperature=1.0, top_k=40, seed=3, logprobs=True),
    ),
}


def trained_copy_step(model: torch.nn.Module) -> None:
    """One SGD step on a language-modelling loss (a trainer's update, in place)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    batch = torch.tensor([random_prompts([24], seed=99)[0]])
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_with_update(model, config, sampling, **engine_options):
    """Submit every prompt, pause once the first request has 3 tokens, step the weights, resume; returns
    (the snapshots at the pause, the results, the version `resume` returned)."""
    with AsyncEngine(model, config=config, max_batch=3, max_model_len=128, **engine_options) as engine:
        handles = [engine.submit(p, dataclasses.replace(sampling, seed=[20 + i])) for i, p in enumerate(PROMPTS)]
        for _ in handles[0].stream(timeout=WAIT_S):
            if len(handles[0].snapshot().tokens) >= 3:
                break
        engine.pause()
        paused = [handle.snapshot() for handle in handles]
        trained_copy_step(model)
        version = engine.resume()
        results = [handle.result(timeout=WAIT_S) for handle in handles]
    return paused, results, version


def fresh_engine_continuations(model, config, sampling, paused) -> list:
    """Each request continued by a new engine on the current weights from its tokens at the pause."""
    with AsyncEngine(model, config=config, max_batch=3, max_model_len=128) as engine:
        handles = [
            engine.submit(p, dataclasses.replace(sampling, seed=[20 + i], max_new_tokens=BUDGET - len(s.tokens)), generated=s.tokens)
            for i, (p, s) in enumerate(zip(PROMPTS, paused, strict=True))
        ]
        return [handle.result(timeout=WAIT_S) for handle in handles]


@pytest.mark.parametrize("case", list(CASES))
def test_requests_in_flight_continue_on_the_new_weights_as_a_fresh_engine_would(tiny_models, case):
    config, sampling = CASES[case]
    model = copy.deepcopy(tiny_models("tiny-llama"))
    if not sampling.temperature:
        old = [oracle_generate(model, p, BUDGET, eos_token_id=[])[0] for p in PROMPTS]
    paused, results, version = run_with_update(model, config, sampling)
    expected = fresh_engine_continuations(model, config, sampling, paused)
    assert version == 1
    changed = False
    for before, result, after in zip(paused, results, expected, strict=True):
        cut = len(before.tokens)
        assert result.tokens[:cut] == before.tokens and result.versions == [0] * cut + [1] * (BUDGET - cut)
        assert result.tokens[cut:] == after.tokens and result.finish_reason == "length"
        if sampling.logprobs:
            assert result.logprobs[cut:] == after.logprobs
        else:
            assert before.tokens == old[PROMPTS.index(before.prompt_ids)][:cut]
            changed |= after.tokens != old[PROMPTS.index(before.prompt_ids)][cut:]
    assert any(len(s.tokens) for s in paused) and any(len(s.tokens) < BUDGET for s in paused)
    assert changed or sampling.temperature  # the step changes the greedy continuations: the oracle can fail


def test_control_reusing_the_pre_update_key_values_fails_the_oracle(tiny_models, monkeypatch):
    config, sampling = CASES["greedy-hf"]
    monkeypatch.setattr(running_batch.RunningBatch, "reprefill", lambda self, version: None)
    model = copy.deepcopy(tiny_models("tiny-llama"))
    paused, results, _ = run_with_update(model, config, sampling)
    expected = fresh_engine_continuations(model, config, sampling, paused)
    assert any(r.tokens[len(s.tokens) :] != e.tokens for s, r, e in zip(paused, results, expected, strict=True))


def test_max_staleness_aborts_started_requests_at_an_update_with_their_tokens(tiny_models):
    config, sampling = CASES["greedy-hf"]
    model = copy.deepcopy(tiny_models("tiny-llama"))
    paused, results, _ = run_with_update(model, config, sampling, max_staleness=0)
    started = [i for i, s in enumerate(paused) if s.tokens]
    assert started
    for index, (before, result) in enumerate(zip(paused, results, strict=True)):
        if index in started:
            assert (result.tokens, result.finish_reason) == (before.tokens, "abort")
        else:  # not started at the update: it runs wholly on the new weights
            assert result.versions == [1] * BUDGET and result.finish_reason == "length"


def test_pause_parks_the_loop_until_resume(tiny_models):
    model = tiny_models("tiny-qwen2")
    with AsyncEngine(model, max_batch=2, max_model_len=64) as engine:
        engine.pause()
        handle = engine.submit(PROMPTS[0], SamplingConfig(max_new_tokens=5, eos_token_id=[]))
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.5)
        assert handle.snapshot().tokens == []
        assert engine.resume() == 0  # no weight change: the same version
        assert handle.result(timeout=WAIT_S).tokens == oracle_generate(model, PROMPTS[0], 5, eos_token_id=[])[0]
