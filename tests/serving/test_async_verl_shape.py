"""verl's server-adapter calls on the engine: an aborted sample resubmitted as prompt + its tokens under its
request id continues exactly (sampled included: its stream goes on at the right step), and a negative
control (a resubmission the adapter does not recognise) restarts the stream and differs."""

from __future__ import annotations

import asyncio
import time

import pytest
from workloads import random_prompts

from autobucket.config import RolloutConfig
from autobucket.serving import AsyncEngine, running_batch
from autobucket.serving.verl_adapter import VerlServerAdapter

pytestmark = pytest.mark.usefixtures("single_thread")

BUDGET = 24
PARAMS = {"max_tokens": BUDGET, "temperature": 1.0, "top_k": 40, "seed": 5, "logprobs": True}


async def interrupted_then_resumed(adapter: VerlServerAdapter, prompt: list[int], resume_id: str):
    """Abort every request once "a" has 3 tokens, resume, resubmit "a" as verl does; (partial, rest)."""
    first = asyncio.ensure_future(adapter.generate(prompt, PARAMS, "a"))
    while not first.done() and len(live_tokens(adapter, "a")) < 3:
        await asyncio.sleep(0.001)
    await adapter.abort_all_requests()
    partial = await first
    await adapter.resume_generation()
    params = {**PARAMS, "max_tokens": BUDGET - len(partial.token_ids)}
    rest = await adapter.generate(prompt + partial.token_ids, params, resume_id)
    return partial, rest


def live_tokens(adapter, request_id):
    """The tokens of the request in flight under `request_id` (none before it is submitted, or while only
    an earlier, finished request of that id is still on record)."""
    request = adapter.engine._live.get(request_id)
    return () if request is None or request.done else request.tokens


def test_an_aborted_sample_resubmitted_with_its_tokens_continues_exactly(tiny_models, monkeypatch):
    step = running_batch.RunningBatch.step

    def slow_step(self, version):  # a few ms a step, so the abort lands mid-request
        time.sleep(0.005)
        step(self, version)

    monkeypatch.setattr(running_batch.RunningBatch, "step", slow_step)
    model = tiny_models("tiny-llama")
    prompt = random_prompts([10], seed=7)[0]
    with AsyncEngine(model, config=RolloutConfig(kernels="invariant"), max_batch=2, max_model_len=64) as engine:
        adapter = VerlServerAdapter(engine)
        whole = asyncio.run(adapter.generate(prompt, PARAMS, "whole"))
        partial, rest = asyncio.run(interrupted_then_resumed(adapter, prompt, "a"))
        partial_again, restarted = asyncio.run(interrupted_then_resumed(adapter, prompt, "not-a"))
    assert partial.stop_reason == "aborted" and 0 < len(partial.token_ids) < BUDGET
    assert rest.stop_reason == "completed" and whole.stop_reason == "completed"
    assert partial.token_ids + rest.token_ids == whole.token_ids
    assert partial.log_probs + rest.log_probs == whole.log_probs
    # the control: resubmitted under another id, its stream starts again at step 0
    assert partial_again.token_ids + restarted.token_ids != whole.token_ids


def test_sleep_and_wake_up_pause_and_resume(tiny_models):
    model = tiny_models("tiny-qwen2")
    with AsyncEngine(model, max_batch=2, max_model_len=64) as engine:
        adapter = VerlServerAdapter(engine)

        async def main():
            await adapter.sleep()
            task = asyncio.ensure_future(adapter.generate([5, 6, 7], {"max_tokens": 4, "temperature": 0}, "x"))
            await asyncio.sleep(0.3)
            assert not task.done() and engine._live["x"].tokens == []
            await adapter.wake_up()
            return await task

        output = asyncio.run(main())
    assert output.stop_reason == "completed" and 1 <= len(output.token_ids) <= 4
