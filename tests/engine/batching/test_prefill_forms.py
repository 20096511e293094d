"""Packed and chunked prefill against the oracle (single-request greedy `model.generate`), and against
`generate` with `prefill_chunk_size` for chunks, on every architecture, both transformers versions.

Packing is forced with a prohibitive per-forward cost (the planner then packs each admission into as
few forwards as it can); chunking by a `prefill_max_tokens` below the longest prompt. Negative
controls: a mask that lets packed prompts see each other, one attention segment for the whole row,
and a chunk that forgets its cached prefix must each fail the same comparison.
"""

from __future__ import annotations

import pytest
import torch
from oracles import assert_matches_oracle, mismatches, oracle_batch
from workloads import ARCHS, random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.engine.batching import chunked_prefill, model_runner, packed_prefill
from autobucket.planning.forms import CHUNKED, DENSE, PACKED, SEGMENTS

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_thread")]

BUDGET = 8  # max_new_tokens
LENGTHS = (5, 17, 30, 3, 9, 40, 12, 1, 26, 7)  # 10 prompts: with 4 rows, refills admit packed groups
PACK_EVERYTHING = CostCoefficients(fixed_ms=1e4)


def rollout(model, route="bucketed", **config) -> Rollout:
    config.setdefault("costs", PACK_EVERYTHING)
    return Rollout(model, config=RolloutConfig(route=route, **config))


def sampling(rows=4, **fields) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=rows, **fields)


def forms_used(result) -> set[str]:
    return {form for admission in result.profile.prefill_forms for form in admission}


def multi_prompt_forms(result) -> set[str]:
    """Forms of the groups with more than one prompt (a lone prompt is cheapest padded: no padding)."""
    profile = result.profile
    return {
        form
        for buckets, forms in zip(profile.prefill_groups, profile.prefill_forms, strict=True)
        for bucket, form in zip(buckets, forms, strict=True)
        if len(bucket) > 1
    }


def force_packing(monkeypatch, attention: str) -> None:
    monkeypatch.setattr(model_runner, "packing_attention", lambda model: attention)
    from autobucket.engine import admission

    monkeypatch.setattr(admission, "packing_attention", lambda model: attention)


# ---- packed ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", [SEGMENTS, DENSE])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_prefill_matches_generate_with_refill_and_eos(tiny_models, monkeypatch, arch, attention):
    model = tiny_models(arch)
    prompts = random_prompts(LENGTHS, seed=ARCHS.index(arch) + 40)
    free_run = oracle_batch(model, prompts, BUDGET)[0]
    eos = free_run[0][2]  # fires at step 3 of prompt 0, so rows retire at different steps
    tokens, reasons = oracle_batch(model, prompts, BUDGET, eos_token_id=eos)
    assert "eos" in reasons and "length" in reasons
    force_packing(monkeypatch, attention)
    result = rollout(model).generate(prompts, sampling(eos_token_id=eos))
    assert_matches_oracle(result, tokens, reasons)
    assert multi_prompt_forms(result) == {PACKED} and len(result.profile.prefill_forms) > 1  # packed, refilled
    assert result.profile.prefill_tokens == sum(LENGTHS)  # no padding at all


def test_the_engine_detects_how_to_pack(tiny_models):
    assert packed_prefill.packing_attention(tiny_models("tiny-qwen2")) == SEGMENTS
    assert packed_prefill.packing_attention(tiny_models("tiny-qwen2", "eager")) == DENSE


@pytest.mark.parametrize("route", ["bucketed", "auto"])
def test_eager_models_pack_with_the_dense_mask_and_stay_exact(tiny_models, route):
    model = tiny_models("tiny-llama", "eager")
    prompts = random_prompts(LENGTHS, seed=3)
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    result = rollout(model, route).generate(prompts, sampling())
    assert_matches_oracle(result, tokens, reasons)
    assert PACKED in forms_used(result)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gpt2"])
def test_packed_prefill_with_penalty_matches_generate(tiny_models, arch):
    model = tiny_models(arch)
    prompts = random_prompts(LENGTHS, seed=7)
    tokens, reasons = oracle_batch(model, prompts, BUDGET, repetition_penalty=1.3)
    result = rollout(model).generate(prompts, sampling(repetition_penalty=1.3))
    assert_matches_oracle(result, tokens, reasons)
    assert multi_prompt_forms(result) == {PACKED}


def test_packed_samples_equal_padded_samples_for_n_and_sampling_streams(tiny_models):
    """Sampling streams are keyed by (seed, prompt, sample, step): packing must not change a draw."""
    model = tiny_models("tiny-qwen3")
    prompts = random_prompts(LENGTHS, seed=9)
    settings = sampling(rows=6, temperature=1.0, top_k=50, seed=123, n=3, logprobs=True)
    packed = rollout(model).generate(prompts, settings)
    padded = rollout(model, "aligned").generate(prompts, settings)
    assert multi_prompt_forms(packed) == {PACKED} and forms_used(padded) == {"padded"}
    assert packed.tokens == padded.tokens
    assert len({tuple(t) for t in packed.flat_tokens()}) > len(prompts)  # the samples do differ
    for got, want in zip(packed.logprobs, padded.logprobs, strict=True):
        for got_sample, want_sample in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(got_sample), torch.tensor(want_sample), rtol=1e-4, atol=1e-4)


def test_packing_off_plans_padded_buckets_only(tiny_models):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(LENGTHS, seed=5)
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    result = rollout(model, packing=False).generate(prompts, sampling())
    assert_matches_oracle(result, tokens, reasons)
    assert forms_used(result) == {"padded"}


def test_control_packed_prompts_that_see_each_other_fail_the_oracle(tiny_models, monkeypatch):
    model = tiny_models("tiny-llama")
    prompts = random_prompts(LENGTHS, seed=11)
    tokens, _ = oracle_batch(model, prompts, BUDGET)
    force_packing(monkeypatch, DENSE)
    block_causal_mask = packed_prefill.block_causal_mask

    def causal_over_the_whole_row(lengths, dtype, device):
        return block_causal_mask([sum(lengths)], dtype, device)

    monkeypatch.setattr(packed_prefill, "block_causal_mask", causal_over_the_whole_row)
    result = rollout(model).generate(prompts, sampling())
    assert len(mismatches(result.tokens, tokens)) >= len(prompts) // 2


def test_control_one_attention_segment_for_the_whole_row_fails_the_oracle(tiny_models, monkeypatch):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(LENGTHS, seed=12)
    tokens, _ = oracle_batch(model, prompts, BUDGET)
    selected = packed_prefill._segments_selected
    # Logits and K/V slices stay per prompt; only the attention blocks merge into one causal row.
    monkeypatch.setattr(packed_prefill, "_segments_selected", lambda bounds: selected([(0, bounds[-1][1])]))
    result = rollout(model).generate(prompts, sampling())
    assert multi_prompt_forms(result) == {PACKED}
    assert len(mismatches(result.tokens, tokens)) >= len(prompts) // 2


# ---- chunked -----------------------------------------------------------------------------------------


def hf_chunked_generate(model, prompt, chunk: int) -> list[int]:
    """The second oracle: `generate` with its own chunked prefill (`prefill_chunk_size`)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        output = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=BUDGET, do_sample=False,
            prefill_chunk_size=chunk, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return output[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_prompts_longer_than_the_budget_are_chunked_on_every_route_and_match_both_oracles(tiny_models, arch):
    model = tiny_models(arch)
    prompts = random_prompts((70, 9, 33, 4, 50), seed=ARCHS.index(arch) + 60)
    tokens, reasons = oracle_batch(model, prompts, BUDGET, eos_token_id=[])
    assert hf_chunked_generate(model, prompts[0], 16) == tokens[0]
    for route in ("aligned", "equal_width", "bucketed", "auto"):
        result = rollout(model, route, prefill_max_tokens=16, costs=None).generate(
            prompts, sampling(rows=3, eos_token_id=[])
        )
        assert_matches_oracle(result, tokens, reasons)
        assert CHUNKED in forms_used(result), route
        assert result.profile.prefill_forwards >= 5 + 3 + 4  # 70 tokens alone take 5 chunks


def test_a_long_prompt_in_chunks_with_n_samples_and_penalty_matches_generate(tiny_models):
    model = tiny_models("tiny-gpt2")
    prompts = random_prompts((90, 12), seed=61)
    tokens, reasons = oracle_batch(model, prompts, BUDGET, repetition_penalty=1.3)
    result = rollout(model, "bucketed", prefill_max_tokens=32, costs=None).generate(
        prompts, sampling(rows=3, repetition_penalty=1.3, n=2, greedy_copies=True)
    )
    assert result.tokens == [[t, t] for t in tokens]  # greedy: both samples equal the oracle
    assert result.finish_reasons == [[r, r] for r in reasons]
    assert CHUNKED in forms_used(result)


def test_control_a_chunk_that_forgets_its_prefix_fails_the_oracle(tiny_models, monkeypatch):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts((70, 60, 45), seed=62)
    tokens, _ = oracle_batch(model, prompts, BUDGET, eos_token_id=[])

    def chunk_only(start, end, device):
        mask = torch.ones((1, end), dtype=torch.long, device=device)
        mask[:, :start] = 0
        return mask

    monkeypatch.setattr(chunked_prefill, "_chunk_mask", chunk_only)
    result = rollout(model, "aligned", prefill_max_tokens=16).generate(prompts, sampling(eos_token_id=[]))
    assert len(mismatches(result.tokens, tokens)) >= 2


def test_a_model_whose_layers_skip_segment_attention_is_refused_not_silently_wrong(tiny_models, monkeypatch):
    """Were the selection not seen by the layers, they would read the placeholder mask (= no mask): refuse."""
    from contextlib import contextmanager

    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(LENGTHS, seed=13)

    @contextmanager
    def not_selected(bounds):
        yield packed_prefill._Packing(bounds)

    with monkeypatch.context() as patch:
        patch.setattr(packed_prefill, "_segments_selected", not_selected)
        with pytest.raises(RuntimeError, match="0 of 2 attention layers.*packing=False"):
            rollout(model).generate(prompts, sampling())
    assert model.config._attn_implementation == "sdpa"
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    assert_matches_oracle(rollout(model).generate(prompts, sampling()), tokens, reasons)  # still usable
