"""A seeded random schedule of 1,000 events against the asynchronous engine: submits arriving staggered
(greedy and seeded-sampled, n samples of a prompt at once, varied budgets), aborts, pause / weight step /
resume, pauses without a step, and resubmits of aborted requests as prompt + their tokens so far.

Oracle, per finished request: cut its tokens where their weights version changes; each run of tokens is
what the same request makes *alone* (an engine of one row) on that version's weights, given its context
up to there (prompt, the tokens it was resubmitted with, its own before the run), bitwise in tokens and
logprobs; greedy runs also equal single-request HF `generate` on those weights. Bookkeeping: every
submission ends (none left hanging), under its own id (none lost or duplicated), an aborted one with a
prefix of its budget, and the engine holds nothing afterwards. The negative control keeps the pre-update
K/V at a weight step and must fail the oracle."""

from __future__ import annotations

import copy
import dataclasses
import random
import time
from dataclasses import dataclass, field

import pytest
import torch
from oracles import hf_greedy
from workloads import random_prompts

from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.serving import AsyncEngine, RequestHandle, RequestOutput, running_batch

pytestmark = pytest.mark.usefixtures("single_thread")

WAIT_S = 300
INVARIANT = RolloutConfig(kernels="invariant")
PROMPTS = random_prompts([2, 5, 9, 3, 14, 7, 11, 4, 16, 6], seed=21)
MOST_TOKENS = 8
# event kind -> weight in the schedule
EVENT_WEIGHTS = {"submit": 34, "abort": 14, "resubmit": 10, "step": 2, "pause": 3, "sleep": 37}


@dataclass
class Submission:
    """One submitted request and what the test knows of it."""

    handle: RequestHandle
    prompt: list[int]
    sampling: SamplingConfig
    sample: int
    generated: list[int]  # the tokens it was submitted with (a resubmission's earlier ones)
    whole_budget: int  # its chain's budget: generated + its own at most
    resubmitted: bool = False
    output: RequestOutput | None = None


@dataclass
class Run:
    """What the schedule did: its submissions and each weights version's state dict."""

    submissions: list[Submission] = field(default_factory=list)
    weights: list[dict[str, torch.Tensor]] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)


def request_sampling(rng: random.Random, budget: int) -> SamplingConfig:
    if rng.random() < 0.5:
        return SamplingConfig(max_new_tokens=budget, eos_token_id=[], logprobs=True)
    top_k = rng.choice([0, 50])
    return SamplingConfig(max_new_tokens=budget, eos_token_id=[], temperature=1.0, top_k=top_k, seed=rng.randrange(2**31), logprobs=True)  # fmt: skip


def weight_step(model: torch.nn.Module, rng: random.Random) -> None:
    """A trainer's in-place update: every weight moved by a random fraction of itself."""
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + 0.3 * torch.randn(parameter.shape, generator=generator))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def run_schedule(model: torch.nn.Module, events: int, seed: int) -> Run:
    """Play `events` random events on an engine over `model` (whose weights the steps change)."""
    rng = random.Random(seed)
    run = Run(weights=[snapshot(model)])
    kinds, weights = list(EVENT_WEIGHTS), list(EVENT_WEIGHTS.values())
    with AsyncEngine(model, config=INVARIANT, max_batch=8, max_model_len=32) as engine:
        for _ in range(events):
            kind = rng.choices(kinds, weights)[0]
            run.events[kind] = run.events.get(kind, 0) + 1
            if kind == "submit":
                prompt, budget = rng.choice(PROMPTS), rng.randint(1, MOST_TOKENS)
                sampling = request_sampling(rng, budget)
                for sample in range(rng.choice([1, 1, 2, 3])):
                    handle = engine.submit(prompt, sampling, sample=sample)
                    run.submissions.append(Submission(handle, prompt, sampling, sample, [], budget))
            elif kind == "abort" and run.submissions:
                abort_a_running_one(run, rng)
            elif kind == "resubmit":
                resubmit_an_aborted_one(engine, run, rng)
            elif kind == "step":
                engine.pause(timeout=WAIT_S)
                weight_step(model, rng)
                run.weights.append(snapshot(model))
                assert engine.resume() == len(run.weights) - 1
            elif kind == "pause":
                engine.pause(timeout=WAIT_S)
                time.sleep(rng.random() / 1000)
                engine.resume()
            else:
                time.sleep(rng.random() * 3 / 1000)
        for submission in run.submissions:
            submission.output = submission.handle.result(timeout=WAIT_S)
        assert engine_left_empty(engine)
    return run


def abort_a_running_one(run: Run, rng: random.Random) -> None:
    """Abort a recent request that is not done, once it has made a token (so most aborts land mid-way);
    without one, any recent request."""
    recent = run.submissions[-24:]
    open_ones = [s for s in recent if not s.handle.done() and int(s.sampling.max_new_tokens) >= 3]
    if not open_ones:
        rng.choice(recent).handle.abort()
        return
    target = rng.choice(open_ones).handle
    next(iter(target.stream(timeout=WAIT_S)))  # its first chunk: a token, or its end
    target.abort()


def resubmit_an_aborted_one(engine: AsyncEngine, run: Run, rng: random.Random) -> None:
    """Submit an aborted request again as prompt + its tokens so far, for the rest of its budget."""
    candidates = [s for s in run.submissions[-40:] if not s.resubmitted and s.handle.done()]
    aborted = [s for s in candidates if s.handle.result().finish_reason == "abort" and s.handle.result().tokens]
    if not aborted:
        return
    earlier = rng.choice(aborted)
    earlier.resubmitted = True
    generated = [*earlier.generated, *earlier.handle.result().tokens]
    left = earlier.whole_budget - len(generated)
    if left == 0:
        return
    sampling = dataclasses.replace(earlier.sampling, max_new_tokens=left)
    handle = engine.submit(earlier.prompt, sampling, sample=earlier.sample, generated=generated)
    run.submissions.append(Submission(handle, earlier.prompt, sampling, earlier.sample, generated, earlier.whole_budget))


def engine_left_empty(engine: AsyncEngine) -> bool:
    deadline = time.monotonic() + WAIT_S
    while engine._live or engine._pending or engine.batch.requests:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@dataclass(frozen=True)
class Piece:
    """A run of one submission's tokens under one weights version."""

    submission: int
    version: int
    start: int  # its first token's index in the submission's tokens
    length: int


def pieces(run: Run) -> list[Piece]:
    found = []
    for index, submission in enumerate(run.submissions):
        versions = submission.output.versions
        start = 0
        for end in range(1, len(versions) + 1):
            if end == len(versions) or versions[end] != versions[start]:
                found.append(Piece(index, versions[start], start, end - start))
                start = end
    return found


def bookkeeping_faults(run: Run) -> list[str]:
    faults = []
    ids = [s.output.request_id for s in run.submissions]
    if len(set(ids)) != len(ids):
        faults.append("a request id was returned twice")
    for index, s in enumerate(run.submissions):
        output, budget = s.output, int(s.sampling.max_new_tokens)
        if output.request_id != s.handle.request_id or output.finish_reason not in ("length", "abort"):
            faults.append(f"submission {index}: {output.request_id} ended {output.finish_reason}")
        if (output.finish_reason == "length") != (len(output.tokens) == budget) or len(output.tokens) > budget:
            faults.append(f"submission {index}: {len(output.tokens)} tokens of {budget}, {output.finish_reason}")
        if len(output.logprobs) != len(output.tokens) or len(output.versions) != len(output.tokens):
            faults.append(f"submission {index}: logprobs or versions not one per token")
        if output.versions != sorted(output.versions):
            faults.append(f"submission {index}: versions go back {output.versions}")
    return faults


def oracle_faults(base_model: torch.nn.Module, run: Run) -> list[str]:
    """Each piece against the same request alone on its version's weights (and greedy ones against HF)."""
    faults = []
    by_version: dict[int, list[Piece]] = {}
    for piece in pieces(run):
        by_version.setdefault(piece.version, []).append(piece)
    for version, found in sorted(by_version.items()):
        model = copy.deepcopy(base_model)
        model.load_state_dict(run.weights[version])
        with AsyncEngine(model, config=INVARIANT, max_batch=1, max_model_len=32) as alone:
            handles = []
            for piece in found:
                s = run.submissions[piece.submission]
                before = [*s.generated, *s.output.tokens[: piece.start]]
                sampling = dataclasses.replace(s.sampling, max_new_tokens=piece.length)
                handles.append(alone.submit(s.prompt, sampling, sample=s.sample, generated=before))
            for piece, handle in zip(found, handles, strict=True):
                s, expected = run.submissions[piece.submission], handle.result(timeout=WAIT_S)
                cut = slice(piece.start, piece.start + piece.length)
                if (s.output.tokens[cut], s.output.logprobs[cut]) != (expected.tokens, expected.logprobs):
                    faults.append(f"{piece}: {s.output.tokens[cut]} alone: {expected.tokens}")
        for piece in found:
            s = run.submissions[piece.submission]
            if not s.sampling.temperature:
                context = [*s.prompt, *s.generated, *s.output.tokens[: piece.start]]
                tokens = s.output.tokens[piece.start : piece.start + piece.length]
                if hf_greedy(model, [context], piece.length)[0] != tokens:
                    faults.append(f"{piece}: {tokens} is not HF generate's")
    return faults


def test_a_thousand_random_events_leave_every_request_exact(tiny_models):
    base = tiny_models("tiny-llama")
    run = run_schedule(copy.deepcopy(base), events=1000, seed=2026)
    assert bookkeeping_faults(run) == []
    assert oracle_faults(base, run) == []
    outputs = [s.output for s in run.submissions]
    resubmitted = [s for s in run.submissions if s.generated]
    # the schedule did what it is for: requests aborted mid-way, resubmitted, and cut by weight steps
    assert sum(o.finish_reason == "abort" and len(o.tokens) > 0 for o in outputs) >= 10
    assert len(resubmitted) >= 10 and len(run.weights) >= 5
    assert sum(len(set(o.versions)) > 1 for o in outputs) >= 5


def test_control_keeping_the_pre_update_key_values_fails_the_oracle(tiny_models, monkeypatch):
    monkeypatch.setattr(running_batch.RunningBatch, "reprefill", lambda self, version: None)
    base = tiny_models("tiny-llama")
    run = run_schedule(copy.deepcopy(base), events=300, seed=7)
    assert bookkeeping_faults(run) == []
    assert oracle_faults(base, run) != []
