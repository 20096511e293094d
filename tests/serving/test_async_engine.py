"""The asynchronous engine against oracles: requests arriving while others run, aborted, streamed.

Greedy requests must equal single-request HF `generate` token for token; sampled ones (with
`kernels="invariant"`) must equal, bitwise in tokens and logprobs, the same request run alone and
`Rollout.generate` of that prompt (the same seed, the same sample). Negative controls break the
engine's row bookkeeping or stream keys and must fail those oracles."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import torch
from oracles import oracle_generate
from workloads import WAIT_S, random_prompts, sampled, wait_for_tokens

from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.engine.rollout import Rollout
from autobucket.serving import AsyncEngine, running_batch

pytestmark = pytest.mark.usefixtures("single_thread")

INVARIANT = RolloutConfig(kernels="invariant", route="aligned")


def greedy(budget: int) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=budget, eos_token_id=[])




def staggered(engine: AsyncEngine, prompts, configs, abort_every: int = 0):
    """Submit each request once the one before has made a token (from two threads in turn), aborting every
    `abort_every`-th once it has made two; returns the handles and the aborted indices."""
    handles, aborted = [None] * len(prompts), set()

    def submit(index: int) -> None:
        handles[index] = engine.submit(prompts[index], configs[index], request_id=f"r{index}")

    for index in range(len(prompts)):
        thread = threading.Thread(target=submit, args=(index,))
        thread.start()
        thread.join()
        if abort_every and index % abort_every == 1:
            wait_for_tokens(handles[index], 2)
            handles[index].abort()
            aborted.add(index)
        else:
            wait_for_tokens(handles[index], 1)
    return handles, aborted


@pytest.mark.parametrize("arch", ["tiny-qwen2", "tiny-llama"])
def test_staggered_arrivals_and_aborts_match_single_request_generate(tiny_models, arch):
    model = tiny_models(arch)
    prompts = random_prompts([5, 17, 3, 9, 12, 30, 7, 21], seed=3)
    budgets = [14, 40, 20, 9, 40, 11, 18, 40]  # the aborted ones (1, 4, 7) long, so the abort lands mid-way
    with AsyncEngine(model, max_batch=3, max_model_len=64) as engine:
        handles, aborted = staggered(engine, prompts, [greedy(b) for b in budgets], abort_every=3)
        outputs = [handle.result(timeout=WAIT_S) for handle in handles]
    for index, output in enumerate(outputs):
        expected, _ = oracle_generate(model, prompts[index], budgets[index], eos_token_id=[])
        if output.finish_reason == "abort":
            assert index in aborted and output.tokens == expected[: len(output.tokens)]
        else:
            assert (output.tokens, output.finish_reason) == (expected, "length"), f"request {index}"
        assert output.versions == [0] * len(output.tokens)
    assert any(o.finish_reason == "abort" for o in outputs) and engine.batch.requests == []


def test_control_a_row_missing_its_last_prompt_token_fails_the_oracle(tiny_models, monkeypatch):
    """The oracle above can fail: rows admitted owning one column too few attend without their last
    prompt token's K/V."""
    original = running_batch.RowInsert

    def short(source_rows, first_tokens, prompt_lengths, seen):
        return original(source_rows, first_tokens, [length - 1 for length in prompt_lengths], seen)

    monkeypatch.setattr(running_batch, "RowInsert", short)
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([5, 17, 9], seed=3)
    with AsyncEngine(model, max_batch=3, max_model_len=64) as engine:
        outputs = [engine.submit(p, greedy(12)).result(timeout=WAIT_S) for p in prompts]
    assert any(o.tokens != oracle_generate(model, p, 12, eos_token_id=[])[0] for p, o in zip(prompts, outputs, strict=True))


def test_sampled_requests_are_bitwise_those_run_alone_and_those_of_rollout_generate(tiny_models):
    model = tiny_models("tiny-llama")
    prompts = random_prompts([6, 14, 3, 22, 9, 11], seed=5)
    configs = [sampled(10 + index, seed=100 + index) for index in range(len(prompts))]
    with AsyncEngine(model, config=INVARIANT, max_batch=4, max_model_len=64) as engine:
        handles, _ = staggered(engine, prompts, configs)
        together = [handle.result(timeout=WAIT_S) for handle in handles]
        alone = [engine.submit(p, c).result(timeout=WAIT_S) for p, c in zip(prompts, configs, strict=True)]
    rollout = Rollout(model, config=INVARIANT)
    for prompt, config, mixed, single in zip(prompts, configs, together, alone, strict=True):
        assert (mixed.tokens, mixed.logprobs) == (single.tokens, single.logprobs)
        reference = rollout.generate([prompt], config)
        assert (mixed.tokens, mixed.logprobs) == (reference.tokens[0], reference.logprobs[0])
    assert len({tuple(o.tokens) for o in together}) == len(prompts)


def test_samples_of_one_prompt_are_rollout_generates_n_samples(tiny_models):
    """Equal prompts share one prefill; sample i is the i-th of `n` in one `Rollout.generate` call."""
    model = tiny_models("tiny-llama")
    prompt = random_prompts([13], seed=8)[0]
    config = sampled(12, seed=4)
    with AsyncEngine(model, config=INVARIANT, max_batch=4, max_model_len=64) as engine:
        handles = [engine.submit(prompt, config, sample=i) for i in range(4)]
        outputs = [handle.result(timeout=WAIT_S) for handle in handles]
    reference = Rollout(model, config=INVARIANT).generate([prompt], dataclasses.replace(config, n=4))
    assert [o.tokens for o in outputs] == reference.tokens[0]
    assert [o.logprobs for o in outputs] == reference.logprobs[0]
    assert len({tuple(o.tokens) for o in outputs}) == 4


def test_control_a_stream_step_off_by_one_fails_the_sampled_oracle(tiny_models, monkeypatch):
    model = tiny_models("tiny-llama")
    prompt, config = random_prompts([9], seed=5)[0], sampled(12, seed=1)
    reference = Rollout(model, config=INVARIANT).generate([prompt], config)
    monkeypatch.setattr(running_batch.Request, "steps_before", property(lambda request: len(request.generated) + 1))
    with AsyncEngine(model, config=INVARIANT, max_batch=2, max_model_len=64) as engine:
        output = engine.submit(prompt, config).result(timeout=WAIT_S)
    assert output.tokens != reference.tokens[0]


def slowed_steps(monkeypatch) -> None:
    """A few ms a decode step, so an abort sent after some tokens lands before the request's end."""
    step = running_batch.RunningBatch.step

    def slow_step(self, version):
        time.sleep(0.005)
        step(self, version)

    monkeypatch.setattr(running_batch.RunningBatch, "step", slow_step)


@pytest.mark.parametrize("config", [greedy(40), sampled(40, seed=9)], ids=["greedy", "sampled"])
def test_an_aborted_request_resubmitted_with_its_tokens_continues_exactly(tiny_models, config, monkeypatch):
    slowed_steps(monkeypatch)
    model = tiny_models("tiny-llama")
    prompt = random_prompts([11], seed=2)[0]
    with AsyncEngine(model, config=INVARIANT, max_batch=2, max_model_len=64) as engine:
        whole = engine.submit(prompt, config).result(timeout=WAIT_S)
        handle = engine.submit(prompt, config)
        wait_for_tokens(handle, 5)
        handle.abort()
        partial = handle.result(timeout=WAIT_S)
        rest = dataclasses.replace(config, max_new_tokens=40 - len(partial.tokens))
        resumed = engine.submit(prompt, rest, generated=partial.tokens).result(timeout=WAIT_S)
    assert partial.finish_reason == "abort" and 0 < len(partial.tokens) < 40
    assert partial.tokens + resumed.tokens == whole.tokens
    if config.logprobs:
        assert partial.logprobs + resumed.logprobs == whole.logprobs


def test_streams_and_awaits_give_the_result_tokens(tiny_models):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([7, 12, 4], seed=6)

    async def collect(handle):
        return [chunk async for chunk in handle]

    async def main(engine):
        handles = [engine.submit(p, greedy(9)) for p in prompts]
        *chunks, awaited = await asyncio.gather(collect(handles[0]), collect(handles[1]), handles[2].wait())
        return chunks, awaited

    with AsyncEngine(model, max_batch=2, max_model_len=64) as engine:
        threaded = list(engine.submit(prompts[0], greedy(9)).stream(timeout=WAIT_S))
        chunks, awaited = asyncio.run(main(engine))
    expected = [oracle_generate(model, p, 9, eos_token_id=[])[0] for p in prompts]
    assert [t for c in threaded for t in c.tokens] == expected[0] and threaded[-1].finish_reason == "length"
    for stream, tokens in zip(chunks, expected, strict=False):
        assert [t for c in stream for t in c.tokens] == tokens and stream[-1].finish_reason == "length"
    assert awaited.tokens == expected[2]


def test_eos_and_stop_reasons_match_generate(tiny_models):
    model = tiny_models("tiny-qwen2")
    prompt = random_prompts([8], seed=4)[0]
    free, _ = oracle_generate(model, prompt, 12, eos_token_id=[])
    eos = free[4]
    expected, reason = oracle_generate(model, prompt, 12, eos_token_id=eos)
    with AsyncEngine(model, max_batch=2, max_model_len=64) as engine:
        output = engine.submit(prompt, SamplingConfig(max_new_tokens=12, eos_token_id=eos)).result(timeout=WAIT_S)
    assert (output.tokens, output.finish_reason) == (expected, reason) and reason == "eos"


BAD_SUBMISSIONS = {
    "n": (dict(n=2), "n=2"),
    "budgets": (dict(max_new_tokens=[3, 4]), "max_new_tokens=[3, 4]"),
    "too long": (dict(max_new_tokens=60), "max_model_len=64"),
}


@pytest.mark.parametrize("case", list(BAD_SUBMISSIONS))
def test_bad_submissions_name_the_field_and_leave_the_engine_serving(tiny_models, case):
    model = tiny_models("tiny-qwen2")
    prompt = random_prompts([8], seed=4)[0]
    fields, words = BAD_SUBMISSIONS[case]
    with AsyncEngine(model, max_batch=2, max_model_len=64) as engine:
        with pytest.raises(ValueError, match=words.replace("[", r"\[")):
            engine.submit(prompt, SamplingConfig(**{"eos_token_id": [], **fields}))
        with pytest.raises(ValueError, match="token id 5000"):
            engine.submit([1, 5000])
        with pytest.raises(ValueError, match="generated has token id -1"):
            engine.submit(prompt, generated=[-1])
        with pytest.raises(ValueError, match="sample=-1"):
            engine.submit(prompt, sample=-1)
        engine.submit(prompt, greedy(30), request_id="same")
        with pytest.raises(ValueError, match="request_id='same' is already in flight"):
            engine.submit(prompt, greedy(3), request_id="same")
        output = engine.submit(prompt, greedy(6)).result(timeout=WAIT_S)
    assert output.tokens == oracle_generate(model, prompt, 6, eos_token_id=[])[0]


def test_a_model_error_reaches_its_requests_unchanged_and_the_engine_goes_on(tiny_models, monkeypatch):
    model = tiny_models("tiny-qwen2")
    prompt = random_prompts([8], seed=4)[0]
    error = RuntimeError("out of memory (simulated)")
    calls = {"left": 1}
    original = running_batch.ModelRunner.decode_logits

    def failing_once(self):
        if calls["left"]:
            calls["left"] -= 1
            raise error
        return original(self)

    monkeypatch.setattr(running_batch.ModelRunner, "decode_logits", failing_once)
    with AsyncEngine(model, max_batch=2, max_model_len=64) as engine:
        with pytest.raises(RuntimeError) as raised:
            engine.submit(prompt, greedy(6)).result(timeout=WAIT_S)
        assert raised.value is error
        output = engine.submit(prompt, greedy(6)).result(timeout=WAIT_S)
    assert output.tokens == oracle_generate(model, prompt, 6, eos_token_id=[])[0]


def test_close_aborts_what_is_in_flight_and_stops_the_loop(tiny_models):
    model = tiny_models("tiny-qwen2")
    engine = AsyncEngine(model, max_batch=2, max_model_len=256)
    handles = [engine.submit(p, greedy(200)) for p in random_prompts([8, 9, 10], seed=1)]
    wait_for_tokens(handles[0], 1)
    engine.close()
    assert all(h.result(timeout=WAIT_S).finish_reason in ("abort", "length") for h in handles)
    assert not engine._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([5, 6])
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("kernels", ["torch", "invariant"])
def test_the_trainers_forwards_on_its_own_thread_are_untouched_while_the_engine_runs(tiny_models, kernels):
    """The engine's per-step scope (kernels, autograd off, eval semantics) is its loop thread's only: the
    trainer's forward meanwhile gives the logits it gave before the engine existed, with autograd on."""
    model = tiny_models("tiny-llama")
    batch = torch.tensor([random_prompts([20], seed=30)[0]])
    with torch.no_grad():
        reference = model(batch).logits
    forwards = 0
    with AsyncEngine(model, config=RolloutConfig(kernels=kernels), max_batch=4, max_model_len=128) as engine:
        handles = [engine.submit(p, greedy(80)) for p in random_prompts([9, 14, 5, 20], seed=31)]
        while not all(handle.done() for handle in handles):
            logits = model(batch).logits
            assert logits.grad_fn is not None and torch.equal(logits.detach(), reference)
            forwards += 1
        outputs = [handle.result(timeout=WAIT_S) for handle in handles]
    assert forwards >= 1 and all(o.finish_reason == "length" for o in outputs)


def test_finished_requests_leave_nothing_behind_in_the_engine(tiny_models):
    """Memory stays flat over many requests: once their handles are dropped, no finished, aborted or
    failed request's record is kept alive by the engine."""
    import gc
    import weakref

    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([4, 6, 3, 5], seed=40)
    records = []
    with AsyncEngine(model, max_batch=4, max_model_len=32) as engine:
        for round_ in range(60):
            handles = [engine.submit(prompts[i], greedy(1 + (round_ + i) % 3)) for i in range(4)]
            handles[round_ % 4].abort()
            for handle in handles:
                handle.result(timeout=WAIT_S)
                records.append(weakref.ref(handle._request))
            del handles, handle
        assert wait_until_empty(engine)
        gc.collect()
        alive = [ref for ref in records if ref() is not None]
        assert alive == [] and len(records) == 240


def wait_until_empty(engine: AsyncEngine, seconds: float = WAIT_S) -> bool:
    deadline = time.monotonic() + seconds
    while engine._live or engine.batch.requests:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_control_an_engine_that_keeps_finished_records_is_caught(tiny_models, monkeypatch):
    import gc
    import weakref

    monkeypatch.setattr(AsyncEngine, "_forget_finished", lambda self, admitted: None)
    model = tiny_models("tiny-qwen2")
    with AsyncEngine(model, max_batch=4, max_model_len=32) as engine:
        handle = engine.submit([5, 6, 7], greedy(2))
        handle.result(timeout=WAIT_S)
        record = weakref.ref(handle._request)
        del handle
        gc.collect()
        assert record() is not None and engine._live


def test_stop_strings_end_requests_where_generate_ends_them(tiny_models):
    import random

    from byte_tokenizer import byte_bpe_tokenizer, corpus_piece
    from oracles import stop_string_oracle
    from workloads import VOCAB

    model, tokenizer = tiny_models("tiny-qwen2"), byte_bpe_tokenizer()
    rng = random.Random(11)
    prompts = [[rng.randrange(259, VOCAB) for _ in range(length)] for length in (5, 17, 9)]
    with AsyncEngine(model, tokenizer, max_batch=3, max_model_len=64) as engine:
        free = [engine.submit(p, greedy(24)).result(timeout=WAIT_S).tokens for p in prompts]
        strings = [corpus_piece(tokenizer.decode(tokens), len(tokenizer.decode(tokens)) // 2, 3) for tokens in free[:2]]
        stopping = SamplingConfig(max_new_tokens=24, eos_token_id=[], stop_strings=strings)
        outputs = [engine.submit(p, stopping).result(timeout=WAIT_S) for p in prompts]
    reasons = []
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = stop_string_oracle(model, tokenizer, prompt, strings, 24, eos_off=True)
        assert (output.tokens, output.finish_reason) == expected
        reasons.append(output.finish_reason)
    assert "stop" in reasons


def test_stop_string_matchers_are_kept_up_to_their_bound(tiny_models):
    """Clients each sending their own stop strings cannot grow the engine's matchers without end; a
    request whose matcher was dropped gets a new one and still stops where generate stops."""
    from byte_tokenizer import byte_bpe_tokenizer

    from autobucket.serving.engine import STOP_MATCHERS_KEPT

    model = tiny_models("tiny-qwen2")
    prompt = random_prompts([6], seed=9)[0]
    with AsyncEngine(model, byte_bpe_tokenizer(), max_batch=4, max_model_len=32) as engine:
        for index in range(STOP_MATCHERS_KEPT + 6):
            stopping = SamplingConfig(max_new_tokens=1, eos_token_id=[], stop_strings=[f"zq{index}"])
            assert engine.submit(prompt, stopping).result(timeout=WAIT_S).tokens == oracle_generate(model, prompt, 1, eos_token_id=[])[0]
        assert engine._stop_matcher.cache_info().currsize == STOP_MATCHERS_KEPT
