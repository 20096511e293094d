"""What a request costs the engine's loop and the server besides its tokens.

- A result's waiter is woken once, when its request ends (waking it for every token made the engine's
  thread hand a thread-safe call to the waiter's event loop per token of every request in flight); a
  stream's reader is still woken as tokens come (the control: the counter sees those wakeups).
- `ignore_eos` (vLLM's option, for benchmarks that need every request the same length) generates through
  EOS: the tokens equal single-request HF `generate` with no EOS; without it the request stops at EOS."""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest
from oracles import oracle_generate
from workloads import firing_eos_candidates, random_prompts

from autobucket import SamplingConfig
from autobucket.serving import AsyncEngine, progress

pytestmark = pytest.mark.usefixtures("single_thread")

ARCH = "tiny-qwen2"
NEW_TOKENS = 12


def counting_wakeups(monkeypatch) -> list[int]:
    """Counts the futures the engine's thread resolves on an event loop."""
    resolved, original = [], progress._resolve

    def counted(future):
        resolved.append(1)
        original(future)

    monkeypatch.setattr(progress, "_resolve", counted)
    return resolved


async def read_while_parked(engine: AsyncEngine, read) -> object:
    """Submit with the loop parked, let the reader wait, then let the loop run: the reader waits from
    before the first token to the end."""
    engine.pause()
    handle = engine.submit([5, 6, 7], SamplingConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[]))
    task = asyncio.ensure_future(read(handle))
    await asyncio.sleep(0.05)
    engine.resume()
    return await task


async def streamed(handle) -> list[int]:
    return [token async for chunk in handle for token in chunk.tokens]


async def awaited(handle) -> list[int]:
    return (await handle).tokens


def test_a_result_waiter_is_woken_once_and_a_stream_reader_per_token(tiny_models, monkeypatch):
    resolved = counting_wakeups(monkeypatch)
    with AsyncEngine(tiny_models(ARCH), max_batch=2, max_model_len=64) as engine:
        tokens = asyncio.run(read_while_parked(engine, awaited))
        assert len(tokens) == NEW_TOKENS and len(resolved) == 1
        resolved.clear()
        assert asyncio.run(read_while_parked(engine, streamed)) == tokens
        assert len(resolved) > NEW_TOKENS // 2  # control: a stream's reader wakes as tokens come


@pytest.fixture(scope="module")
def eos_model(tiny_models):
    """The tiny model with an EOS id that greedy decoding emits mid-completion for some prompts."""
    model = copy.deepcopy(tiny_models(ARCH))
    prompts = random_prompts([4, 9, 6, 12], seed=3)
    candidates = firing_eos_candidates([oracle_generate(model, p, NEW_TOKENS, eos_token_id=[])[0] for p in prompts])
    assert candidates, "no token ends some greedy completions but not all: change the prompts"
    model.generation_config.eos_token_id = candidates[0]
    return model, prompts


def test_ignore_eos_generates_through_eos_to_max_tokens(eos_model):
    model, prompts = eos_model
    with AsyncEngine(model, max_batch=4, max_model_len=64) as engine, engine.serve() as server:
        ended = []
        for prompt in prompts:
            params = {"max_tokens": NEW_TOKENS, "temperature": 0}
            stops = httpx.post(f"{server.url}/generate", json={"prompt_ids": prompt, "sampling_params": params}, timeout=120).json()
            params["ignore_eos"] = True
            through = httpx.post(f"{server.url}/generate", json={"prompt_ids": prompt, "sampling_params": params}, timeout=120).json()
            assert through["token_ids"] == oracle_generate(model, prompt, NEW_TOKENS, eos_token_id=[])[0]
            assert through["finish_reason"] == "length"
            assert stops["token_ids"] == oracle_generate(model, prompt, NEW_TOKENS)[0]
            ended.append(stops["finish_reason"] == "eos")
        assert any(ended)  # control: without it, some request stopped at EOS
        bad = httpx.post(f"{server.url}/generate", json={"prompt_ids": [5], "sampling_params": {"ignore_eos": "maybe"}})
        assert bad.status_code == 400 and "sampling_params.ignore_eos" in bad.json()["error"]["message"]
