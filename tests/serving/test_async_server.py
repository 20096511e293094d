"""The OpenAI-compatible server, through real clients (the `openai` package and httpx) against uvicorn on
127.0.0.1: every completion's tokens equal single-request HF `generate` (greedy) or `Rollout.generate` of
the same seed (sampled), its text the tokenizer's decoding of them; bad input of every kind is a 400
naming the field with the server still serving; a client that goes away aborts its request."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
from byte_tokenizer import chat_tokenizer
from oracles import oracle_generate
from workloads import random_prompts

from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.engine.rollout import Rollout
from autobucket.prompts import conversation_ids
from autobucket.serving import AsyncEngine
from autobucket.serving.server import default_model_name

pytestmark = pytest.mark.usefixtures("single_thread")

ARCH = "tiny-qwen2"
WAIT_S = 120


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def served(tiny_models, tokenizer, single_thread):
    """(engine, server, model) for the module: one engine, one server on a free loopback port."""
    model = tiny_models(ARCH)
    engine = AsyncEngine(model, tokenizer, max_batch=8, max_model_len=256)
    server = engine.serve("127.0.0.1", 0)
    yield engine, server, model
    server.close()
    engine.close()


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0)


def wait_until(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_openai_completions_from_text_and_ids_match_generate(served, tokenizer):
    engine, server, model = served
    client = client_for(server)
    text = "abc fed gah"
    ids = tokenizer(text)["input_ids"]
    expected, _ = oracle_generate(model, ids, 12)
    for prompt in (text, ids):
        completion = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
        choice = completion.choices[0]
        assert choice.token_ids == expected and choice.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert len(choice.logprobs.token_logprobs) == len(expected) and completion.usage.prompt_tokens == len(ids)


def test_openai_chat_matches_generate_on_the_templated_prompt(served, tokenizer):
    engine, server, model = served
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc def"}]
    expected, _ = oracle_generate(model, conversation_ids(tokenizer, messages), 10)
    chat = client_for(server).chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0, logprobs=True)
    message = chat.choices[0]
    assert message.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert message.model_extra["token_ids"] == expected and len(message.logprobs.content) == len(expected)


def test_openai_streaming_gives_the_whole_completion_in_pieces(served, tokenizer):
    engine, server, model = served
    client = client_for(server)
    ids = random_prompts([9], seed=3)[0]
    expected, _ = oracle_generate(model, ids, 14)
    chunks = list(client.completions.create(model="m", prompt=ids, max_tokens=14, temperature=0, stream=True))
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == expected
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(expected, skip_special_tokens=True)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and len(chunks) > 2
    messages = [{"role": "user", "content": "gah"}]
    expected, _ = oracle_generate(model, conversation_ids(tokenizer, messages), 8)
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, stream=True)
    pieces = list(stream)
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == tokenizer.decode(expected, skip_special_tokens=True)


def test_n_sampled_choices_are_rollout_generates_n_samples(served):
    engine, server, model = served
    ids = random_prompts([11], seed=4)[0]
    completion = client_for(server).completions.create(model="m", prompt=ids, max_tokens=10, temperature=1.0, top_p=0.9, n=3, seed=77)
    reference = Rollout(model, config=RolloutConfig(route="aligned")).generate(
        [ids], SamplingConfig(max_new_tokens=10, temperature=1.0, top_p=0.9, n=3, seed=77)
    )
    assert [c.token_ids for c in completion.choices] == reference.tokens[0]
    assert len({tuple(c.token_ids) for c in completion.choices}) == 3


def test_sixty_four_concurrent_clients_each_get_their_own_oracle_answer(served):
    engine, server, model = served
    prompts = random_prompts([3 + (7 * i) % 29 for i in range(64)], seed=12)
    budgets = [4 + i % 9 for i in range(64)]

    def ask(index: int):
        body = {"prompt_ids": prompts[index], "sampling_params": {"max_tokens": budgets[index], "temperature": 0}}
        if index % 2:
            return httpx.post(f"{server.url}/generate", json=body, timeout=WAIT_S).json()["token_ids"]
        completion = client_for(server).completions.create(model="m", prompt=prompts[index], max_tokens=budgets[index], temperature=0)
        return completion.choices[0].token_ids

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(ask, range(64)))
    for prompt, budget, answer in zip(prompts, budgets, answers, strict=True):
        assert answer == oracle_generate(model, prompt, budget)[0]


def test_generate_applies_the_repetition_penalty_as_generate_does(served):
    engine, server, model = served
    ids = random_prompts([7], seed=13)[0]
    free, _ = oracle_generate(model, ids, 16)
    expected, reason = oracle_generate(model, ids, 16, repetition_penalty=3.0)
    assert expected != free  # the penalty bites: the oracle could fail
    params = {"max_tokens": 16, "temperature": 0, "repetition_penalty": 3.0}
    body = httpx.post(f"{server.url}/generate", json={"prompt_ids": ids, "sampling_params": params}, timeout=WAIT_S).json()
    assert (body["token_ids"], body["finish_reason"]) == (expected, reason)


def test_generate_and_abort_over_http(served):
    engine, server, model = served
    ids = random_prompts([6], seed=5)[0]
    body = {"prompt_ids": ids, "request_id": "long-one", "logprobs": True,
            "sampling_params": {"max_tokens": 240, "temperature": 0, "min_tokens": 240}}  # fmt: skip
    engine.pause()  # queued; paused again once it has tokens, so the abort lands before it finishes
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{server.url}/generate", json=body, timeout=WAIT_S)
        assert wait_until(lambda: "long-one" in engine._live)
        handle_request = engine._live["long-one"]
        engine.resume()
        assert wait_until(lambda: len(handle_request.tokens) >= 2)
        engine.pause()
        aborted = httpx.post(f"{server.url}/abort", json={"request_id": "long-one"}).json()
        engine.resume()
        answer = pending.result().json()
    assert aborted == {"aborted": ["long-one"]}
    assert answer["finish_reason"] == "abort" and 0 < len(answer["token_ids"]) < 240
    expected, _ = oracle_generate(model, ids, 240, min_new_tokens=240)
    assert answer["token_ids"] == expected[: len(answer["token_ids"])] and answer["versions"][0] == 0
    assert len(answer["logprobs"]) == len(answer["token_ids"])


BAD_REQUESTS = [
    ("/generate", b"{not json", "body"),
    ("/generate", [1, 2], "body"),
    ("/generate", {}, "prompt_ids"),
    ("/generate", {"prompt_ids": []}, "prompt_ids"),
    ("/generate", {"prompt_ids": "abc"}, "prompt_ids"),
    ("/generate", {"prompt_ids": [1, 2.5]}, "prompt_ids.1"),
    ("/generate", {"prompt_ids": [1, 99999]}, "token id 99999"),
    ("/generate", {"prompt_ids": [1], "generated": [-3]}, "generated has token id -3"),
    ("/generate", {"prompt_ids": [1], "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
    ("/generate", {"prompt_ids": [1], "sampling_params": {"max_tokens": 10**6}}, "max_model_len=256"),
    ("/generate", {"prompt_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("/generate", {"prompt_ids": [1], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ("/generate", {"prompt_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ("/generate", {"prompt_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n=2"),
    ("/generate", {"prompt_ids": [1], "sampling_params": {"seed": -1}}, "sampling_params.seed"),
    ("/generate", {"prompt_ids": [1], "sampling_params": {"presence_penalty": 0.5}}, "presence_penalty"),
    ("/generate", {"prompt_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "sampling_params.repetition_penalty"),
    ("/generate", {"prompt_ids": [1], "sampling_params": {"stop": [1]}}, "sampling_params.stop"),
    ("/generate", {"prompt_ids": [1], "request_id": ""}, "request_id"),
    ("/generate", {"prompt_ids": [1], "sample": -1}, "sample"),
    ("/generate", {"prompt_ids": [1], "surprise": 1}, "surprise"),
    ("/v1/completions", {"prompt": "abc", "logprobs": 5}, "logprobs"),
    ("/v1/completions", {"prompt": "abc", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": ["abc", "def"]}, "one per request"),
    ("/v1/completions", {"prompt": None}, "prompt"),
    ("/v1/completions", {"prompt": "abc", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "abc", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "abc", "max_tokens": -4, "stream": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
    ("/abort", {}, "request_id or all"),
    ("/abort", {"request_id": 5}, "request_id"),
]


@pytest.mark.parametrize(("path", "body", "named"), BAD_REQUESTS, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD_REQUESTS)])
def test_bad_http_input_is_a_400_naming_the_field_and_the_server_goes_on(served, path, body, named):
    engine, server, model = served
    sent = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{server.url}{path}", timeout=WAIT_S, **sent)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]
    good = httpx.post(f"{server.url}/generate", json={"prompt_ids": [5, 6], "sampling_params": {"max_tokens": 3, "temperature": 0}})
    assert good.status_code == 200 and good.json()["token_ids"] == oracle_generate(model, [5, 6], 3)[0]
    assert wait_until(lambda: engine._live == {} and not server.app.state.in_flight)


def test_a_duplicate_request_id_in_flight_is_a_400(served):
    engine, server, model = served
    engine.pause()
    try:
        first = engine.submit([5, 6, 7], SamplingConfig(max_new_tokens=3), request_id="twice")
        response = httpx.post(f"{server.url}/generate", json={"prompt_ids": [5], "request_id": "twice"})
        assert response.status_code == 400 and "request_id='twice'" in response.json()["error"]["message"]
    finally:
        engine.resume()
    assert first.result(timeout=WAIT_S).finish_reason in ("eos", "length")


def test_a_client_that_disconnects_aborts_its_request(served):
    engine, server, model = served
    engine.pause()  # nothing runs: only the disconnect can end these requests
    try:
        body = {"prompt_ids": [5, 6, 7], "sampling_params": {"max_tokens": 50}}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            timed_out = pool.submit(httpx.post, f"{server.url}/generate", json=body, timeout=3)
            assert wait_until(lambda: len(engine._live) == 1)
            with pytest.raises(httpx.ReadTimeout):
                timed_out.result()
        assert wait_until(lambda: not engine._live and not server.app.state.in_flight)
        chat = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 50, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat, timeout=WAIT_S) as response:
            lines = response.iter_lines()  # held: a dropped line iterator closes the response
            assert next(lines).startswith("data: ")
            streaming = set(server.app.state.in_flight)
            assert streaming and streaming <= set(engine._live)
        assert wait_until(lambda: not engine._live and not server.app.state.in_flight)
    finally:
        engine.resume()


def test_control_a_paused_request_without_a_disconnect_stays_in_flight(served):
    """The check above can fail: a request whose client stays connected is still in flight."""
    engine, server, model = served
    engine.pause()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{server.url}/generate", json={"prompt_ids": [5, 6]}, timeout=WAIT_S)
            assert wait_until(lambda: len(engine._live) == 1)
            assert not wait_until(lambda: not engine._live, seconds=1.0)
            engine.resume()
            assert pending.result().status_code == 200
    finally:
        if engine.paused:
            engine.resume()


def test_health_and_models(served):
    engine, server, model = served
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "weights_version": 0, "paused": False}
    assert client_for(server).models.list().data[0].id == default_model_name(model)


def test_shutdown_aborts_what_is_in_flight_and_stops_serving(tiny_models):
    model = tiny_models(ARCH)
    with AsyncEngine(model, max_batch=2, max_model_len=64) as engine:
        server = engine.serve()
        engine.pause()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{server.url}/generate", json={"prompt_ids": [5, 6]}, timeout=WAIT_S)
            assert wait_until(lambda: len(engine._live) == 1)
            server.close()
            answer = pending.result().json()
        engine.resume()
        assert answer["finish_reason"] == "abort" and not server._thread.is_alive()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=2)


def test_the_server_binds_loopback_only(tiny_models):
    with AsyncEngine(tiny_models(ARCH), max_batch=1, max_model_len=16) as engine, pytest.raises(ValueError, match="loopback"):
        engine.serve("0.0.0.0", 0)


def test_the_serve_command_serves_the_model_until_interrupted(tiny_models):
    import os
    import signal
    import subprocess
    import sys

    command = [sys.executable, "-m", "autobucket.cli", "serve", "--model", ARCH, "--port", "0", "--threads", "1",
               "--max-batch", "4", "--max-model-len", "64"]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ})
    try:
        line = process.stderr.readline()
        assert "listening on" in line, line + process.stderr.read()
        url = line.split("listening on ")[1].split()[0]
        ids = random_prompts([9], seed=21)[0]
        completion = openai.OpenAI(base_url=url, api_key="unused", timeout=WAIT_S, max_retries=0).completions.create(
            model="m", prompt=ids, max_tokens=8, temperature=0)
        assert completion.choices[0].token_ids == oracle_generate(tiny_models(ARCH), ids, 8)[0]
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
