"""Memory stays flat over 10,000 requests: short requests through `AsyncEngine` (greedy and sampled, some
aborted, some with stop strings of their own, some through the HTTP server's /generate) leave nothing
behind once they finish and their handles are dropped.

Checks, after a warm-up round (caches, allocator pools, the server's first connections): the engine's own
structures are empty (requests in flight, the waiting queue, the batch's rows, the server's in-flight
ids), no request record is alive (weak references), the Python heap grew less than its bound over the
second 5,000 requests (tracemalloc: blocks allocated then and still held), and the process RSS grew less
than its bound over all 10,000.

Bounds. Heap, 1 MiB over 5,000 requests (about 200 bytes a request): one leaked request record (its
lists, its `Progress` condition, its sampling config and the copy of the model's GenerationConfig in its
resolved generation) holds kilobytes, so keeping records passes the bound many times over, as does a
leaked per-request dict; what stays under it is the interpreter's and libraries' own small caches,
which do not grow with the requests. RSS, 64 MiB: it also counts the allocator's and torch's pools, which do not shrink at once, so its bound is loose; it catches
what the heap does not see, a tensor kept per request (a vocab-wide fp32 logits row, 4 KiB, is 40 MiB
over 10,000 requests; two are past the bound). The negative control keeps every finished record in the
engine and must be caught by the heap bound."""

from __future__ import annotations

import concurrent.futures
import gc
import time
import tracemalloc
import weakref

import httpx
import pytest
from byte_tokenizer import byte_bpe_tokenizer
from workloads import random_prompts

from autobucket.config import SamplingConfig
from autobucket.serving import AsyncEngine

pytestmark = pytest.mark.usefixtures("single_thread")

WAIT_S = 300
SETTLE_S = 10
REQUESTS = 10_000
WAVE = 500  # requests in flight at once
HTTP_SHARE = 20  # one request in this many goes through the server
HEAP_BOUND = 1 << 20  # over the second 5,000 requests
RSS_BOUND = 64 << 20
PROMPTS = random_prompts([2, 3, 4, 3, 2, 4, 3, 2], seed=50)


def request_sampling(index: int) -> SamplingConfig:
    """Short requests of every kind: greedy or sampled, one or two tokens, every 7th with stop strings
    (of a few: their matchers are built in the warm-up round, as a trainer's few stop strings are)."""
    stops = [f"zq{index % 5}"] if index % 7 == 0 else []
    if index % 2:
        return SamplingConfig(max_new_tokens=1 + index % 2, eos_token_id=[], stop_strings=stops)
    return SamplingConfig(max_new_tokens=1 + index % 3 // 2, eos_token_id=[], temperature=1.0, seed=index, stop_strings=stops, logprobs=True)  # fmt: skip


def http_generate(client: httpx.Client, index: int) -> dict:
    body = {"prompt_ids": PROMPTS[index % len(PROMPTS)], "sampling_params": {"max_tokens": 2, "temperature": 0}}
    response = client.post("/generate", json=body, timeout=WAIT_S)
    response.raise_for_status()
    return response.json()


def run_wave(engine: AsyncEngine, client: httpx.Client, pool, first: int, count: int, records: list) -> None:
    """`count` requests from index `first`: in process, every 9th aborted, and one in HTTP_SHARE over HTTP."""
    handles, calls = [], []
    for index in range(first, first + count):
        if index % HTTP_SHARE == 0:
            calls.append(pool.submit(http_generate, client, index))
            continue
        handles.append(engine.submit(PROMPTS[index % len(PROMPTS)], request_sampling(index)))
        if index % 9 == 0:
            handles[-1].abort()
    for handle in handles:
        assert handle.result(timeout=WAIT_S).finish_reason in ("length", "abort", "stop")
    for call in calls:
        assert call.result(timeout=WAIT_S)["finish_reason"] == "length"
    records.extend(weakref.ref(handle._request) for handle in handles[::50])


def engine_settled(engine: AsyncEngine, server) -> None:
    """Wait for the loop to forget the last finished requests (it does so after its step) and the server
    to drop their ids (after its response): until then they are rightly held. A correct engine settles
    within a step; one that keeps them never does, and the checks after report it."""
    deadline = time.monotonic() + SETTLE_S
    while engine._live or engine.batch.requests or server.app.state.in_flight:
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


def rss() -> int:
    psutil = pytest.importorskip("psutil")
    return psutil.Process().memory_info().rss


def memory_faults(model, tokenizer, requests: int) -> list[str]:
    """Run `requests` requests after a warm-up round; what is left behind, as faults. The heap is traced
    over the second half only: by then every structure sized by the requests in flight (dict tables, the
    queue's blocks) has reached its size, so what the second half adds is what requests leave behind."""
    faults, records = [], []
    half = requests // 2 // WAVE * WAVE
    with AsyncEngine(model, tokenizer, max_batch=64, max_model_len=16) as engine, engine.serve("127.0.0.1", 0) as server:
        with httpx.Client(base_url=server.url, limits=httpx.Limits(max_keepalive_connections=0)) as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
            run_wave(engine, client, pool, 0, WAVE, [])  # warm-up
            engine_settled(engine, server)
            gc.collect()
            before_rss = rss()
            for first in range(WAVE, WAVE + half, WAVE):
                run_wave(engine, client, pool, first, WAVE, records)
            engine_settled(engine, server)
            gc.collect()
            tracemalloc.start()
            try:
                for first in range(WAVE + half, WAVE + requests, WAVE):
                    run_wave(engine, client, pool, first, min(WAVE, WAVE + requests - first), records)
                engine_settled(engine, server)
                gc.collect()
                heap = tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()
            grown_rss = rss() - before_rss
        left = {
            "requests in flight": len(engine._live), "waiting": len(engine._pending),
            "rows": len(engine.batch.requests), "server in flight": len(server.app.state.in_flight),
        }  # fmt: skip
        faults += [f"{what}: {count}" for what, count in left.items() if count]
    alive = sum(record() is not None for record in records)
    if alive:
        faults.append(f"{alive} of {len(records)} sampled request records alive")
    if heap >= HEAP_BOUND:
        faults.append(f"python heap grew {heap} bytes")
    if grown_rss >= RSS_BOUND:
        faults.append(f"RSS grew {grown_rss} bytes")
    return faults


def test_ten_thousand_requests_leave_nothing_behind(tiny_models):
    assert memory_faults(tiny_models("tiny-qwen2"), byte_bpe_tokenizer(), REQUESTS) == []


def test_control_an_engine_keeping_finished_records_is_caught(tiny_models, monkeypatch):
    monkeypatch.setattr(AsyncEngine, "_forget_finished", lambda self, admitted: None)
    faults = memory_faults(tiny_models("tiny-qwen2"), byte_bpe_tokenizer(), 2_000)
    assert any(fault.startswith("python heap grew") for fault in faults), faults
