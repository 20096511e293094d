"""A property test of the engine's bookkeeping: random submit / abort / pause / resume events (about 200
in all) from the caller's thread while the loop runs. Whatever the order, every request ends (none left
hanging), with the tokens single-request `generate` makes (a prefix of them, when aborted), under its own
id (none lost or duplicated), and nothing is left in the engine."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import oracle_generate
from workloads import random_prompts

from autobucket.config import SamplingConfig
from autobucket.serving import AsyncEngine

WAIT_S = 120
MOST_TOKENS = 6
PROMPTS = random_prompts([3, 8, 5, 11, 2, 7], seed=13)

EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, len(PROMPTS) - 1), st.integers(1, MOST_TOKENS)),
        st.tuples(st.just("abort"), st.integers(0, 63), st.just(0)),
        st.tuples(st.just("pause"), st.just(0), st.just(0)),
        st.tuples(st.just("resume"), st.just(0), st.just(0)),
        st.tuples(st.just("sleep"), st.integers(0, 3), st.just(0)),
    ),
    min_size=20,
    max_size=40,
)


@pytest.mark.usefixtures("single_thread")
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=EVENTS)
def test_random_events_lose_duplicate_or_strand_no_request(tiny_models, events):
    model = tiny_models("tiny-qwen2")
    expected = [oracle_generate(model, p, MOST_TOKENS, eos_token_id=[])[0] for p in PROMPTS]
    submitted = []  # (handle, prompt index, budget, aborted)
    with AsyncEngine(model, max_batch=3, max_model_len=32) as engine:
        for kind, value, budget in events:
            if kind == "submit":
                handle = engine.submit(PROMPTS[value], SamplingConfig(max_new_tokens=budget, eos_token_id=[]))
                submitted.append([handle, value, budget, False])
            elif kind == "abort" and submitted:
                entry = submitted[value % len(submitted)]
                entry[0].abort()
                entry[3] = True
            elif kind == "pause":
                engine.pause(timeout=WAIT_S)
            elif kind == "resume":
                engine.resume()
            elif kind == "sleep":
                time.sleep(value / 1000)
        engine.resume()
        outputs = [handle.result(timeout=WAIT_S) for handle, *_ in submitted]
        deadline = time.monotonic() + WAIT_S
        while engine._live and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine._live and not engine.batch.requests
    assert len({o.request_id for o in outputs}) == len(submitted)
    for output, (handle, prompt, budget, aborted) in zip(outputs, submitted, strict=True):
        assert output.request_id == handle.request_id
        full = expected[prompt][:budget]
        if aborted and output.finish_reason == "abort":
            assert output.tokens == full[: len(output.tokens)]
        else:
            assert (output.tokens, output.finish_reason) == (full, "length")
