"""Requests with equal prompts read one copy of the prompt's K/V in the asynchronous engine, as the n
samples of a `Rollout.generate` call do; several contexts admitted together share one prefill forward
under the batch-invariant kernels.

Oracles: with `kernels="invariant"`, sample i of a prompt submitted as its own request (staggered,
joining while its siblings run, aborted and resumed, across a weight step) is bitwise, in tokens and
logprobs, sample i of `Rollout.generate([prompt], n)` and the same request run alone; greedy ones equal
single-request HF `generate`. The sharing itself is counted: one copy per prompt in flight, rows reading
it, no per-request prefill, and nothing held once the requests are done. Negative controls point a row
at another prompt's copy, and pack admissions on kernels that are not batch-invariant."""

from __future__ import annotations

import collections
import copy
import dataclasses
import threading
import time

import pytest
import torch
from oracles import hf_greedy, oracle_generate
from workloads import WAIT_S, random_prompts, sampled, steering_hook, wait_for_tokens

from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.engine.batching import model_runner
from autobucket.engine.rollout import Rollout
from autobucket.serving import AsyncEngine, running_batch
from autobucket.serving.prefill_forwards import forward_batches

pytestmark = pytest.mark.usefixtures("single_thread")

INVARIANT = RolloutConfig(kernels="invariant")




class SharingSeen:
    """Records, at every decode step, how many rows read each shared copy and how many copies are held."""

    def __init__(self, monkeypatch) -> None:
        self.most_rows_on_one_copy, self.most_copies = 0, 0
        step = running_batch.RunningBatch.step

        def watched(batch, version):
            store = batch.runner.store
            readers = collections.Counter(g for g in store.prefix_of if g >= 0)
            self.most_rows_on_one_copy = max(self.most_rows_on_one_copy, max(readers.values(), default=0))
            self.most_copies = max(self.most_copies, len(store.shared_prefixes))
            step(batch, version)

        monkeypatch.setattr(running_batch.RunningBatch, "step", watched)


def assert_engine_holds_nothing(engine: AsyncEngine) -> None:
    """Once the loop has retired the last rows (a result is out before its row leaves), no row, shared
    copy or prompt record is left."""
    deadline = time.monotonic() + WAIT_S
    while (engine._live or engine._pending or engine.batch.requests) and time.monotonic() < deadline:
        time.sleep(0.01)
    batch = engine.batch
    assert batch.requests == [] and dict(batch.prompts) == {}
    assert batch.runner.store is None or (batch.runner.store.shared_prefixes == {} and batch.runner.store.active_rows == 0)


def staggered_samples(engine: AsyncEngine, prompts, config, samples: int):
    """Each prompt's samples submitted one by one, prompt-major, each once the one before has a token (so
    a prompt's later samples join while its earlier ones run); handles[p][s]."""
    handles = [[None] * samples for _ in prompts]
    for p, prompt in enumerate(prompts):
        for s in range(samples):
            handles[p][s] = engine.submit(prompt, config, sample=s, request_id=f"p{p}s{s}")
            wait_for_tokens(handles[p][s], 1)
    return handles


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2", "tiny-gpt2", "tiny-opt"])  # engine step; model forward
def test_staggered_samples_read_one_copy_and_are_rollout_generates_n_samples(tiny_models, arch, monkeypatch):
    seen = SharingSeen(monkeypatch)
    model = tiny_models(arch)
    prompts = random_prompts([13, 21, 7], seed=11)
    config = sampled(40, seed=5)
    with AsyncEngine(model, config=INVARIANT, max_batch=12, max_model_len=64) as engine:
        handles = staggered_samples(engine, prompts, config, 4)
        outputs = [[h.result(timeout=WAIT_S) for h in row] for row in handles]
        alone = engine.submit(prompts[1], config, sample=2).result(timeout=WAIT_S)
        copies, forwards = engine.batch.copies_made, engine.batch.prefill_forwards
        decode_form = engine.batch.runner.decode_step
        assert_engine_holds_nothing(engine)
    rollout = Rollout(model, config=INVARIANT)
    for prompt, row in zip(prompts, outputs, strict=True):
        reference = rollout.generate([prompt], dataclasses.replace(config, n=4))
        assert [o.tokens for o in row] == reference.tokens[0]
        assert [o.logprobs for o in row] == reference.logprobs[0]
    assert (alone.tokens, alone.logprobs) == (outputs[1][2].tokens, outputs[1][2].logprobs)
    # each prompt prefilled once for its four samples: the first holds its own copy, the three joining
    # later read one shared copy; the lone request at the end is prefilled again and shares nothing
    assert (copies, forwards) == (len(prompts), len(prompts) + 1)
    assert seen.most_rows_on_one_copy == 3 and seen.most_copies <= len(prompts)
    assert decode_form == ("engine" if arch in ("tiny-llama", "tiny-qwen2") else "model")


def test_greedy_requests_on_one_copy_equal_single_request_generate(tiny_models, monkeypatch):
    seen = SharingSeen(monkeypatch)
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([9, 17], seed=12)
    budgets = [20, 7, 14]
    with AsyncEngine(model, max_batch=6, max_model_len=64) as engine:
        handles = []
        for budget in budgets:
            for prompt in prompts:
                handles.append(engine.submit(prompt, SamplingConfig(max_new_tokens=budget, eos_token_id=[])))
                wait_for_tokens(handles[-1], 1)
        outputs = [h.result(timeout=WAIT_S) for h in handles]
        assert_engine_holds_nothing(engine)
    for index, output in enumerate(outputs):
        budget, prompt = budgets[index // 2], prompts[index % 2]
        assert output.tokens == oracle_generate(model, prompt, budget, eos_token_id=[])[0]
    assert seen.most_rows_on_one_copy >= 2


def test_aborted_siblings_leave_the_others_exact_and_resume_on_the_held_copy(tiny_models, monkeypatch):
    """Two of a prompt's four samples are aborted mid-way while the others run, then resumed with their
    tokens so far: only those tokens are prefilled, continuing from the copy the running siblings hold."""
    seen = SharingSeen(monkeypatch)
    model = tiny_models("tiny-llama")
    prompt = random_prompts([19], seed=13)[0]
    config = sampled(40, seed=8)
    with AsyncEngine(model, config=INVARIANT, max_batch=4, max_model_len=64) as engine:
        engine.pause()
        handles = [engine.submit(prompt, config, sample=s) for s in range(4)]
        engine.resume()
        wait_for_tokens(handles[1], 5)
        engine.pause()  # the aborts and the resubmissions land while the siblings are mid-way
        for s in (1, 3):
            handles[s].abort()
        partial = {s: handles[s].result(timeout=WAIT_S) for s in (1, 3)}
        assert handles[0].snapshot().finish_reason is None, "a sibling still runs on the copy"
        resumed = {
            s: engine.submit(prompt, dataclasses.replace(config, max_new_tokens=40 - len(partial[s].tokens)), sample=s,
                             generated=partial[s].tokens)
            for s in (1, 3)
        }  # fmt: skip
        engine.resume()
        running = {s: handles[s].result(timeout=WAIT_S) for s in (0, 2)}
        finished = {s: resumed[s].result(timeout=WAIT_S) for s in (1, 3)}
        copies = engine.batch.copies_made
        assert_engine_holds_nothing(engine)
    reference = Rollout(model, config=INVARIANT).generate([prompt], dataclasses.replace(config, n=4))
    for s in (0, 2):
        assert (running[s].tokens, running[s].logprobs) == (reference.tokens[0][s], reference.logprobs[0][s])
    for s in (1, 3):
        assert partial[s].finish_reason == "abort" and 0 < len(partial[s].tokens) < 40
        assert partial[s].tokens + finished[s].tokens == reference.tokens[0][s]
        assert partial[s].logprobs + finished[s].logprobs == reference.logprobs[0][s]
    assert copies == 1 and seen.most_rows_on_one_copy == 4


def test_a_weight_step_mid_way_remakes_one_copy_per_prompt_and_continues_exactly(tiny_models):
    """After pause / step / resume every row is re-prefilled: one copy per prompt under the new weights,
    each row's own tokens continued from it; the tokens after the step equal a fresh engine's on the new
    weights from each row's context there, bitwise."""
    model = copy.deepcopy(tiny_models("tiny-qwen2"))
    prompts = random_prompts([11, 15], seed=14)
    config = sampled(24, seed=3)
    with AsyncEngine(model, config=INVARIANT, max_batch=6, max_model_len=64) as engine:
        engine.pause()
        handles = [[engine.submit(p, config, sample=s) for s in range(3)] for p in prompts]
        engine.resume()
        wait_for_tokens(handles[1][2], 5)
        engine.pause()
        before = engine.batch.copies_made
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1.25)
        engine.resume()
        outputs = [[h.result(timeout=WAIT_S) for h in row] for row in handles]
        remade = engine.batch.copies_made - before
        assert_engine_holds_nothing(engine)
    stepped = 0
    for prompt, row in zip(prompts, outputs, strict=True):
        for sample, output in enumerate(row):
            cut = output.versions.index(1) if 1 in output.versions else len(output.tokens)
            after = output.tokens[cut:]
            if not after:
                continue
            stepped += 1
            rest = dataclasses.replace(config, max_new_tokens=len(after))
            with AsyncEngine(model, config=INVARIANT, max_batch=1, max_model_len=64) as fresh:  # the new weights
                alone = fresh.submit(prompt, rest, sample=sample, generated=output.tokens[:cut]).result(timeout=WAIT_S)
            assert (alone.tokens, alone.logprobs) == (after, output.logprobs[cut:])
    assert stepped == 6 and remade == len(prompts)


def test_control_a_row_pointed_at_another_prompts_copy_fails_the_oracle(tiny_models, monkeypatch):
    """The oracles above can fail: a request joining its prompt's held copy is pointed at another one."""
    insert = model_runner.ModelRunner.insert_sharing

    def other_copy(self, prefix, rows, own=None):
        if isinstance(prefix, int):
            prefix = next((g for g in self.store.shared_prefixes if g != prefix), prefix)
        return insert(self, prefix, rows, own)

    monkeypatch.setattr(model_runner.ModelRunner, "insert_sharing", other_copy)
    model = tiny_models("tiny-llama")
    prompts = random_prompts([13, 21], seed=11)
    config = sampled(20, seed=5)
    with AsyncEngine(model, config=INVARIANT, max_batch=8, max_model_len=64) as engine:
        engine.pause()
        first = [engine.submit(p, config, sample=s) for p in prompts for s in (0, 2)]  # a copy per prompt
        engine.resume()
        wait_for_tokens(first[1], 2)
        engine.pause()
        late = engine.submit(prompts[0], config, sample=1)  # joins its prompt's held copy
        engine.resume()
        late = late.result(timeout=WAIT_S)
        for handle in first:
            handle.result(timeout=WAIT_S)
    reference = Rollout(model, config=INVARIANT).generate([prompts[0]], dataclasses.replace(config, n=3))
    assert late.tokens != reference.tokens[0][1]


PACKINGS = {  # config -> prefill forwards of the five prompts below (30, 17, 45, 9, 60 tokens)
    "one forward": (INVARIANT, 1),
    "64 tokens a forward": (RolloutConfig(kernels="invariant", prefill_max_tokens=64), 3),  # 30+17 | 45+9 | 60
    "packing off": (RolloutConfig(kernels="invariant", packing=False), 5),
}


@pytest.mark.parametrize("packing", list(PACKINGS))
def test_contexts_admitted_together_share_prefill_forwards_bitwise(tiny_models, packing):
    """Under the invariant kernels an admission's prompts are prefilled packed, as many a forward as
    `prefill_max_tokens` lets, each request's tokens and logprobs bitwise those of `Rollout.generate` of
    its prompt alone."""
    config, expected_forwards = PACKINGS[packing]
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([30, 17, 45, 9, 60], seed=5)
    configs = [sampled(10, seed=20 + i) for i in range(len(prompts))]
    with AsyncEngine(model, config=config, max_batch=8, max_model_len=96) as engine:
        engine.pause()
        handles = [engine.submit(p, c) for p, c in zip(prompts, configs, strict=True)]
        engine.resume()
        outputs = [h.result(timeout=WAIT_S) for h in handles]
        forwards = engine.batch.prefill_forwards
    rollout = Rollout(model, config=INVARIANT)
    for prompt, config, output in zip(prompts, configs, outputs, strict=True):
        reference = rollout.generate([prompt], config)
        assert (output.tokens, output.logprobs) == (reference.tokens[0], reference.logprobs[0])
    assert forwards == expected_forwards


def test_forward_batches_fit_the_token_budget():
    lengths = [5, 7, 3, 9]
    assert forward_batches(lengths, True, None) == [[0, 1, 2, 3]]
    assert forward_batches(lengths, True, 12) == [[0, 1], [2, 3]]  # packed: the sum
    assert forward_batches(lengths, True, 14, padded=True) == [[0, 1], [2], [3]]  # padded: rows x longest
    assert forward_batches([20, 4], True, 12) == [[0], [1]]  # one longer than the budget runs alone
    assert forward_batches(lengths, False, None) == [[0], [1], [2], [3]]


def test_non_invariant_kernels_prefill_each_context_alone(tiny_models):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([30, 17, 45], seed=5)
    with AsyncEngine(model, config=RolloutConfig(kernels="torch"), max_batch=4, max_model_len=96) as engine:
        engine.pause()
        handles = [engine.submit(p, SamplingConfig(max_new_tokens=8, eos_token_id=[])) for p in prompts]
        engine.resume()
        outputs = [h.result(timeout=WAIT_S) for h in handles]
        forwards = engine.batch.prefill_forwards
    assert [o.tokens for o in outputs] == hf_greedy(model, prompts, 8) and forwards == len(prompts)


def test_control_packing_on_kernels_that_are_not_batch_invariant_changes_logprobs(tiny_models, monkeypatch):
    """Why packing waits for the invariant kernels: forced on with the model's own kernels, a packed
    request's logprobs are no longer bitwise those of its prompt prefilled alone."""
    follow = running_batch.RunningBatch.follow_plan

    def packing_forced(batch, plan, model_changed):
        follow(batch, plan, model_changed)
        batch.together = True

    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([30, 17, 45, 9, 60], seed=5)
    configs = [sampled(6, seed=20 + i) for i in range(len(prompts))]
    torch_kernels = RolloutConfig(kernels="torch")

    def run() -> list:
        with AsyncEngine(model, config=torch_kernels, max_batch=8, max_model_len=96) as engine:
            engine.pause()
            handles = [engine.submit(p, c) for p, c in zip(prompts, configs, strict=True)]
            engine.resume()
            return [h.result(timeout=WAIT_S).logprobs for h in handles]

    alone = run()
    monkeypatch.setattr(running_batch.RunningBatch, "follow_plan", packing_forced)
    assert run() != alone


def test_the_decode_step_follows_the_model_a_hook_added_mid_run_is_seen(tiny_models):
    """The engine's Llama-family step decodes where it may stand in for the model's forward; a forward
    hook added while requests run (a trainer's steering) moves decoding to the model's forward, which
    runs it: tokens after it equal HF generate with the hook from that context."""
    model = copy.deepcopy(tiny_models("tiny-llama"))
    prompt = random_prompts([12], seed=15)[0]
    greedy = SamplingConfig(max_new_tokens=30, eos_token_id=[])
    with AsyncEngine(model, max_batch=2, max_model_len=64) as engine:
        engine.pause()
        handle = engine.submit(prompt, greedy)
        engine.resume()
        wait_for_tokens(handle, 4)
        engine.pause()
        assert engine.batch.runner.decode_step == "engine"
        hook = model.model.layers[0].register_forward_hook(steering_hook(model))
        engine.resume()
        output = handle.result(timeout=WAIT_S)
        form = engine.batch.runner.decode_step
    try:
        cut = output.versions.index(1)
        expected = hf_greedy(model, [prompt + output.tokens[:cut]], len(output.tokens) - cut)[0]
    finally:
        hook.remove()
    assert form == "model" and 0 < cut < 30 and output.tokens[cut:] == expected


def test_control_a_decode_form_kept_after_a_hook_misses_it(tiny_models, monkeypatch):
    follow = running_batch.RunningBatch.follow_plan
    monkeypatch.setattr(running_batch.RunningBatch, "follow_plan",
                        lambda batch, plan, model_changed: follow(batch, plan, False))  # fmt: skip
    model = copy.deepcopy(tiny_models("tiny-llama"))
    prompt = random_prompts([12], seed=15)[0]
    with AsyncEngine(model, max_batch=2, max_model_len=64) as engine:
        engine.pause()
        handle = engine.submit(prompt, SamplingConfig(max_new_tokens=30, eos_token_id=[]))
        engine.resume()
        wait_for_tokens(handle, 4)
        engine.pause()
        hook = model.model.layers[0].register_forward_hook(steering_hook(model))
        engine.resume()
        output = handle.result(timeout=WAIT_S)
    try:
        cut = output.versions.index(1)
        expected = hf_greedy(model, [prompt + output.tokens[:cut]], len(output.tokens) - cut)[0]
    finally:
        hook.remove()
    assert output.tokens[cut:] != expected


def test_threads_submitting_siblings_at_once_share_and_stay_exact(tiny_models):
    model = tiny_models("tiny-llama")
    prompts = random_prompts([10, 16], seed=16)
    config = sampled(16, seed=9)
    results = {}

    def client(p: int, s: int) -> None:
        results[p, s] = engine.submit(prompts[p], config, sample=s).result(timeout=WAIT_S)

    with AsyncEngine(model, config=INVARIANT, max_batch=8, max_model_len=64) as engine:
        threads = [threading.Thread(target=client, args=(p, s)) for s in range(4) for p in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        copies = engine.batch.copies_made
        assert_engine_holds_nothing(engine)
    rollout = Rollout(model, config=INVARIANT)
    for p, prompt in enumerate(prompts):
        reference = rollout.generate([prompt], dataclasses.replace(config, n=4))
        assert [results[p, s].tokens for s in range(4)] == reference.tokens[0]
        assert [results[p, s].logprobs for s in range(4)] == reference.logprobs[0]
    assert copies >= len(prompts)


def test_the_plan_is_chosen_at_the_first_step_and_again_only_after_the_model_changed(tiny_models, monkeypatch):
    from autobucket.engine import rollout as rollout_module

    chosen = []
    choose = rollout_module.choose_plan
    monkeypatch.setattr(rollout_module, "choose_plan", lambda *args, **kwargs: chosen.append(choose(*args, **kwargs)) or chosen[-1])
    model = copy.deepcopy(tiny_models("tiny-llama"))
    prompt = random_prompts([12], seed=15)[0]
    with AsyncEngine(model, max_batch=2, max_model_len=64) as engine:
        engine.submit(prompt, SamplingConfig(max_new_tokens=20, eos_token_id=[])).result(timeout=WAIT_S)
        before_hook = [plan.decode_step for plan in chosen]
        engine.pause()
        hook = model.model.layers[0].register_forward_hook(steering_hook(model))
        engine.resume()
        engine.submit(prompt, SamplingConfig(max_new_tokens=5, eos_token_id=[])).result(timeout=WAIT_S)
        engine.pause()  # the loop parked: no step runs after the hook is gone
        hook.remove()
    assert before_hook == ["engine"] and [plan.decode_step for plan in chosen] == ["engine", "model"]
