"""One host record per (prompt, sample): the runner's device arrays mirror the batcher's `Request` records,
and one resolved record holds a call's sampling settings.

Oracle for the mirror: each active record's own fields (its newest token, its position, its seen ids, its
cache row and shared-prefix group) read against row `cache_row` of the device arrays and of the cache, before
and after every decode step of runs with refills, early finishes, several samples per prompt, a penalty and a
shared prefix. The negative control shifts one record's newest token and must be reported."""

from __future__ import annotations

import pytest
import torch
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.batching import batcher as batcher_module
from autobucket.engine.generation_setup import resolve_generation
from autobucket.engine.sampling.streams import request_seeds

pytestmark = pytest.mark.usefixtures("single_thread")


def mirror_mismatches(batcher) -> list[str]:
    """Where the runner's per-row device arrays or the cache's groups disagree with the batcher's records."""
    runner, requests = batcher.runner, batcher.rows
    if runner.rows.count != len(requests):
        return [f"{runner.rows.count} device rows for {len(requests)} records"]
    tokens, positions = runner.rows.tokens.tolist(), runner.rows.positions.tolist()
    problems = []
    for row, request in enumerate(requests):
        where = f"row {row} (prompt {request.prompt}, sample {request.sample})"
        if request.cache_row != row:
            problems.append(f"{where}: cache_row {request.cache_row}")
        if tokens[row] != request.tokens[-1] or positions[row] != request.position:
            problems.append(f"{where}: device ({tokens[row]}, {positions[row]}), record ({request.tokens[-1]}, {request.position})")
        group = runner.store.prefix_of[row]
        if (None if group < 0 else group) != request.shared_prefix:
            problems.append(f"{where}: cache group {group}, record {request.shared_prefix}")
        if runner.seen is not None:
            seen = runner.seen[row].nonzero().flatten().tolist()
            if seen != sorted({*request.prompt_ids, *request.tokens}):
                problems.append(f"{where}: seen ids differ")
    return problems


def run_checked(monkeypatch, model, prompts, sampling, config) -> tuple[list, int]:
    """The call's result, and how many decode steps were checked (each before and after)."""
    original, checked = batcher_module.ContinuousBatcher._decode_step, []

    def decode_step(batcher):
        assert mirror_mismatches(batcher) == []
        if not checked:  # negative control: a record whose newest token moved is caught
            request = batcher.rows[-1]
            request.tokens.append(request.tokens[-1] + 1)
            assert mirror_mismatches(batcher) != []
            request.tokens.pop()
        original(batcher)
        assert mirror_mismatches(batcher) == []
        assert all(request.cache_row is None for request in batcher.finished.values())
        checked.append(True)

    monkeypatch.setattr(batcher_module.ContinuousBatcher, "_decode_step", decode_step)
    return Rollout(model, config=config).generate(prompts, sampling), len(checked)


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_device_rows_mirror_the_records_through_refills_and_finishes(monkeypatch, tiny_models, penalty):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts((6, 19, 3, 11, 8), seed=5)
    # 3 rows for 10 requests: refills; budgets of 2..9: rows finish at different steps and leave holes
    sampling = SamplingConfig(
        max_new_tokens=[9, 2, 5, 7, 4], n=2, temperature=0.8, seed=11, repetition_penalty=penalty,
        continuous_batch_size=3, eos_token_id=[],
    )
    result, steps = run_checked(monkeypatch, model, prompts, sampling, RolloutConfig(route="equal_width"))
    assert steps >= 9
    assert [[len(t) for t in per_prompt] for per_prompt in result.tokens] == [[9, 9], [2, 2], [5, 5], [7, 7], [4, 4]]


def test_rows_reading_a_shared_prefix_record_its_group(monkeypatch, tiny_models, always_share):
    """A prompt's samples admitted together read one copy of its K/V: each record names that cache group."""
    model = tiny_models("tiny-llama")
    prompts = random_prompts((40, 12), seed=2)
    sampling = SamplingConfig(max_new_tokens=4, n=3, temperature=1.0, seed=3, continuous_batch_size=6, eos_token_id=[])
    config = RolloutConfig(route="equal_width")
    shared = []
    original = batcher_module.ContinuousBatcher._insert

    def insert(batcher, *args):
        original(batcher, *args)
        shared.extend(request.shared_prefix for request in batcher.rows)

    monkeypatch.setattr(batcher_module.ContinuousBatcher, "_insert", insert)
    result, steps = run_checked(monkeypatch, model, prompts, sampling, config)
    assert steps == 3 and result.profile.shared_kv_rows > 0
    assert any(group is not None for group in shared)


def test_one_record_holds_the_calls_sampling_settings(tiny_models):
    """The penalty, EOS ids and min_new_tokens resolve once, into the selection; `for_prompts` adds each
    prompt's budget and stream key as `SamplingConfig` and the streams define them."""
    model = tiny_models("tiny-llama")
    sampling = SamplingConfig(max_new_tokens=[3, 5], seed=7, repetition_penalty=1.2, min_new_tokens=2, eos_token_id=[4, 9])
    resolved = resolve_generation(model, sampling, {}, model.config.vocab_size).for_prompts(sampling, 2)
    selection = resolved.selection
    assert (selection.repetition_penalty, selection.eos_token_ids, selection.min_new_tokens) == (1.2, (4, 9), 2)
    assert resolved.eos_token_ids == (4, 9) and resolved.generation_config.eos_token_id == [4, 9]
    assert selection.sampler.request_seeds == request_seeds(7, 2) and resolved.budgets == (3, 5)
    assert resolved.per_prompt_budgets and resolved.most_new_tokens == 5
    assert selection.logits_dtype == next(model.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="max_new_tokens has 2 values for 3 prompts"):
        resolved.for_prompts(sampling, 3)
