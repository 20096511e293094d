"""Every route against the oracle: single-request greedy `model.generate`, token for token.

Workloads are the reference's five shapes scaled down, plus a mixed one (random lengths, more
prompts than rows, an EOS that fires mid-generation for some prompts only). Negative controls
break a position, a mask or the penalty on purpose and check that the same comparison fails.
"""

from __future__ import annotations

import functools
import random
from collections import deque
from dataclasses import dataclass

import pytest
import torch
from oracles import assert_matches_oracle, mismatches, oracle_batch, oracle_generate
from workloads import (
    ARCHS,
    CB_ROUTES,
    ROUTES,
    choose_firing_eos,
    cut_length,
    firing_eos_candidates,
    random_prompts,
)

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.batching.static_cache import StaticKVCache

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_thread")]

BUDGET = 10  # max_new_tokens for every workload here
MIXED_ROWS = 4  # continuous_batch_size of the mixed workload (12 prompts: refill is exercised)
MIXED_LENGTHS = tuple(random.Random(5).choices(range(1, 49), k=12))
WORKLOADS = {
    "short_similar": list(range(20, 12, -1)) * 2,
    "long_tail": [128] + [8] * 15,
    "short_tail": [20] + [1] * 15,
    "moderate_tail": [64] + [4] * 15,
    "spread": list(range(16, 129, 16)),
}
WORKLOAD_ROWS = 8
PENALTY_ARCHS = ("tiny-llama", "tiny-gpt2")


@dataclass(frozen=True)
class Case:
    """A workload with its oracle answer under one EOS setting."""

    prompts: list[list[int]]
    eos: int | list[int] | None
    tokens: list[list[int]]
    reasons: list[str]


@functools.cache
def mixed_prompts(arch: str) -> list[list[int]]:
    return random_prompts(MIXED_LENGTHS, seed=ARCHS.index(arch) + 11)


def mixed_case(model, arch: str) -> Case:
    """The mixed workload with an EOS that the oracle emits at step >= 2 for some prompts only, and
    early enough that rows retire at different steps (refills admit fewer than MIXED_ROWS prompts)."""
    prompts = mixed_prompts(arch)
    free_run = oracle_batch(model, prompts, BUDGET)[0]
    for eos in firing_eos_candidates(free_run):
        admissions, _, _ = simulate_schedule([cut_length(t, eos) for t in free_run], MIXED_ROWS)
        if any(len(admitted) < MIXED_ROWS for admitted in admissions[1:-1]):
            tokens, reasons = oracle_batch(model, prompts, BUDGET, eos_token_id=eos)
            return Case(prompts, eos, tokens, reasons)
    raise AssertionError(f"no EOS staggers the {arch} mixed workload: change its seed")


def run(model, prompts, route="aligned", rows=MIXED_ROWS, eos=None, penalty=1.0, budget=BUDGET, **config):
    rollout = Rollout(model, config=RolloutConfig(route=route, **config))
    sampling = SamplingConfig(
        max_new_tokens=budget, continuous_batch_size=rows, repetition_penalty=penalty, eos_token_id=eos
    )
    return rollout.generate(prompts, sampling)


def simulate_schedule(lengths: list[int], rows: int) -> tuple[list[list[int]], int, int]:
    """The CB schedule implied by the oracle's output lengths: (admissions, decode forwards, peak rows).

    Free rows are refilled from the queue before each decode step; a row whose first (prefill) token
    already ends it never takes a row.
    """
    queue, active = deque(range(len(lengths))), {}
    admissions, decode_forwards, peak = [], 0, 0
    while queue or active:
        if queue and len(active) < rows:
            admitted = [queue.popleft() for _ in range(min(rows - len(active), len(queue)))]
            admissions.append(admitted)
            active.update({i: 1 for i in admitted if lengths[i] > 1})
            peak = max(peak, len(active))
        if active:
            decode_forwards += 1
            for i in list(active):
                active[i] += 1
                if active[i] == lengths[i]:
                    del active[i]
    return admissions, decode_forwards, peak


# ---- token exactness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("route", ROUTES)
def test_every_route_matches_generate_on_every_arch_with_refill_and_eos(tiny_models, route, arch):
    model = tiny_models(arch)
    case = mixed_case(model, arch)
    # the workload is what it claims: EOS ends some rows at step >= 2, others run to the budget
    assert any(r == "eos" and len(t) >= 3 for t, r in zip(case.tokens, case.reasons, strict=True))
    assert "length" in case.reasons
    result = run(model, case.prompts, route, eos=case.eos)
    assert_matches_oracle(result, case.tokens, case.reasons)
    assert result.route == route
    if route != "ordinary":
        assert len(result.profile.prefill_groups) > 1  # rows were refilled


@pytest.mark.parametrize("arch", ARCHS)
def test_uniform_lengths_take_the_unmasked_decode_path_and_stay_exact(tiny_models, arch, monkeypatch):
    """Equal prompt lengths leave nothing to mask, so decode passes no mask (HF builds none either)."""
    model = tiny_models(arch)
    prompts = random_prompts([11] * 6, seed=21)
    tokens, reasons = oracle_batch(model, prompts, 7, eos_token_id=[])
    masks = []
    step_mask = StaticKVCache.step_mask
    monkeypatch.setattr(StaticKVCache, "step_mask", lambda self: masks.append(step_mask(self)) or masks[-1])
    for route in CB_ROUTES:
        sampling = SamplingConfig(max_new_tokens=7, continuous_batch_size=6, eos_token_id=[])
        # compile=False: the unmasked path is the eager step's (the compiled step always masks)
        result = Rollout(model, config=RolloutConfig(route=route, compile=False)).generate(prompts, sampling)
        assert_matches_oracle(result, tokens, reasons)
    assert masks and all(mask is None for mask in masks)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("route", ROUTES)
def test_every_workload_shape_matches_generate(tiny_models, route, workload):
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(WORKLOADS[workload], seed=sorted(WORKLOADS).index(workload))
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    result = run(model, prompts, route, rows=WORKLOAD_ROWS)
    assert_matches_oracle(result, tokens, reasons)


@pytest.mark.parametrize("arch", PENALTY_ARCHS)
@pytest.mark.parametrize("route", ROUTES)
def test_repetition_penalty_matches_generate(tiny_models, route, arch):
    model = tiny_models(arch)
    prompts = mixed_prompts(arch)
    tokens, reasons = oracle_batch(model, prompts, BUDGET, repetition_penalty=1.3)
    assert mismatches(tokens, oracle_batch(model, prompts, BUDGET)[0])  # the penalty changes the output
    result = run(model, prompts, route, penalty=1.3)
    assert_matches_oracle(result, tokens, reasons)


@pytest.mark.parametrize("route", ROUTES)
def test_sampling_penalty_replaces_the_penalty_in_the_models_generation_config(
    tiny_models, monkeypatch, route
):
    model = tiny_models("tiny-gpt2")
    prompts = mixed_prompts("tiny-gpt2")
    tokens, reasons = oracle_batch(model, prompts, BUDGET, repetition_penalty=1.3)
    assert mismatches(tokens, oracle_batch(model, prompts, BUDGET, repetition_penalty=3.0)[0])
    monkeypatch.setattr(model.generation_config, "repetition_penalty", 3.0)
    assert_matches_oracle(run(model, prompts, route, penalty=1.3), tokens, reasons)


@pytest.mark.parametrize("trim_cache", [False, True])
@pytest.mark.parametrize("arch", PENALTY_ARCHS)
@pytest.mark.parametrize("route", CB_ROUTES)
def test_trim_cache_keeps_tokens_exact(tiny_models, route, arch, trim_cache):
    model = tiny_models(arch)
    case = mixed_case(model, arch)
    result = run(model, case.prompts, route, eos=case.eos, trim_cache=trim_cache)
    assert_matches_oracle(result, case.tokens, case.reasons)
    # Whether a retirement leaves dead columns depends on which row goes first; here aligned rows do.
    if trim_cache and route == "aligned":
        assert result.profile.trims > 0 and result.profile.trimmed_columns > 0


@pytest.mark.parametrize("arch", PENALTY_ARCHS)
@pytest.mark.parametrize("route", CB_ROUTES)
def test_small_cache_capacity_trims_and_stays_exact(tiny_models, route, arch):
    # Every prompt fits alone (longest + BUDGET - 1 columns); the schedule's growing front does not.
    model = tiny_models(arch)
    case = mixed_case(model, arch)
    capacity = max(MIXED_LENGTHS) + BUDGET
    result = run(model, case.prompts, route, eos=case.eos, cache_capacity=capacity)
    assert_matches_oracle(result, case.tokens, case.reasons)
    assert result.profile.cache_capacity == capacity
    assert result.profile.trims > 0


@pytest.mark.parametrize("route", CB_ROUTES)
def test_refill_when_the_front_reaches_the_capacity_admits_a_wider_prompt(tiny_models, route):
    # Prompt 1 ends at prefill (its first token is the EOS), so the two rows retire one step apart and
    # the shared front climbs one column per step until it reaches the default capacity while the
    # only surviving row is a 1-token prompt. Trimming then leaves a front of 2, and the next
    # admission (an 8-token prompt) must still fit. Lengths alternate 1/8 so either parity hits it.
    model = tiny_models("tiny-qwen2")
    budget = 3
    lengths = [1, 10] + [1, 8] * 12
    for seed in range(20):
        prompts = random_prompts(lengths, seed=100 + seed)
        eos = oracle_generate(model, prompts[1], budget)[0][0]
        tokens, reasons = oracle_batch(model, prompts, budget, eos_token_id=eos)
        if reasons.count("eos") == 1:
            break
    assert tokens[1] == [eos] and reasons.count("eos") == 1
    result = run(model, prompts, route, rows=2, eos=eos, budget=budget)
    assert_matches_oracle(result, tokens, reasons)


@pytest.mark.parametrize("route", ROUTES)
def test_eager_attention_matches_generate(tiny_models, route):
    model = tiny_models("tiny-llama", attn_implementation="eager")
    case = mixed_case(model, "tiny-llama")
    result = run(model, case.prompts, route, eos=case.eos)
    assert_matches_oracle(result, case.tokens, case.reasons)


@pytest.mark.parametrize("route", ROUTES)
def test_one_row_and_one_token_budgets_match_generate(tiny_models, route):
    model = tiny_models("tiny-opt")
    case = mixed_case(model, "tiny-opt")
    result = run(model, case.prompts, route, rows=1, eos=case.eos)
    assert_matches_oracle(result, case.tokens, case.reasons)

    tokens, reasons = oracle_batch(model, case.prompts, 1)
    result = run(model, case.prompts, route, budget=1)
    assert_matches_oracle(result, tokens, reasons)
    assert result.profile.decode_forwards == 0


def test_equal_width_prefill_token_limit_splits_groups_and_stays_exact(tiny_models):
    model = tiny_models("tiny-qwen3")
    case = mixed_case(model, "tiny-qwen3")
    limit = 64
    result = run(model, case.prompts, "equal_width", eos=case.eos, prefill_max_tokens=limit)
    assert_matches_oracle(result, case.tokens, case.reasons)
    profile = result.profile
    admissions, _, _ = simulate_schedule([len(t) for t in case.tokens], MIXED_ROWS)
    assert [[i for g in groups for i in g] for groups in profile.prefill_groups] == admissions
    groups = [g for groups in profile.prefill_groups for g in groups]
    padded = [len(g) * max(len(case.prompts[i]) for i in g) for g in groups]
    assert all(tokens <= limit for tokens, g in zip(padded, groups, strict=True) if len(g) > 1)
    assert profile.prefill_forwards == len(groups) > len(admissions)
    assert profile.prefill_tokens == sum(padded)


# ---- result layout and generation options -------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_results_come_back_in_input_order(tiny_models, route):
    model = tiny_models("tiny-llama")
    case = mixed_case(model, "tiny-llama")
    order = list(reversed(range(len(case.prompts))))
    order[0], order[5] = order[5], order[0]
    result = run(model, [case.prompts[i] for i in order], route, eos=case.eos)
    assert_matches_oracle(result, [case.tokens[i] for i in order], [case.reasons[i] for i in order])


def test_prompts_may_be_lists_tuples_or_tensors(tiny_models):
    model = tiny_models("tiny-qwen2")
    prompts = mixed_prompts("tiny-qwen2")[:3]
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    mixed_types = [prompts[0], tuple(prompts[1]), torch.tensor(prompts[2])]
    assert_matches_oracle(run(model, mixed_types), tokens, reasons)


@pytest.mark.parametrize("route", ROUTES)
def test_generate_padded_equals_generate_on_the_unpadded_lists(tiny_models, route):
    model = tiny_models("tiny-mistral")
    case = mixed_case(model, "tiny-mistral")
    width = max(len(p) for p in case.prompts)
    input_ids = torch.full((len(case.prompts), width), 7, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(case.prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    rollout = Rollout(model, config=RolloutConfig(route=route))
    sampling = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=MIXED_ROWS, eos_token_id=case.eos)
    padded = rollout.generate_padded(input_ids, attention_mask, sampling)
    assert_matches_oracle(padded, case.tokens, case.reasons)
    assert padded.tokens == rollout.generate(case.prompts, sampling).tokens


def test_to_padded_right_pads_responses_with_a_mask(tiny_models):
    model = tiny_models("tiny-llama")
    case = mixed_case(model, "tiny-llama")
    result = run(model, case.prompts, eos=case.eos)
    responses, mask = result.to_padded(pad_id=-1)
    longest = max(len(t) for t in case.tokens)
    assert responses.shape == mask.shape == (len(case.prompts), longest)
    assert responses.dtype == mask.dtype == torch.long
    for row, tokens in enumerate(case.tokens):
        assert responses[row, : len(tokens)].tolist() == tokens
        assert mask[row].tolist() == [1] * len(tokens) + [0] * (longest - len(tokens))
        assert (responses[row, len(tokens) :] == -1).all()


@pytest.mark.parametrize("route", ROUTES)
def test_a_generated_token_equal_to_the_pad_id_is_kept(tiny_models, route):
    model = tiny_models("tiny-qwen2")  # no EOS in its generation config
    prompts = mixed_prompts("tiny-qwen2")
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    pad = tokens[0][3]  # emitted mid-row: an engine that strips or stops at pad ids loses it
    rollout = Rollout(model, config=RolloutConfig(route=route))
    sampling = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=MIXED_ROWS)
    result = rollout.generate(prompts, sampling, pad_token_id=pad)
    assert_matches_oracle(result, tokens, reasons)
    assert pad in result.tokens[0]


@pytest.mark.parametrize("route", ROUTES)
def test_eos_may_be_a_list_of_ids(tiny_models, route):
    model = tiny_models("tiny-qwen3")
    prompts = mixed_prompts("tiny-qwen3")
    first = choose_firing_eos(oracle_batch(model, prompts, BUDGET)[0])
    not_ended_by_first = [
        t for t in oracle_batch(model, prompts, BUDGET, eos_token_id=first)[0] if first not in t
    ]
    other = choose_firing_eos(not_ended_by_first)
    tokens, reasons = oracle_batch(model, prompts, BUDGET, eos_token_id=[first, other])
    ended_by = {t[-1] for t, r in zip(tokens, reasons, strict=True) if r == "eos"}
    assert ended_by == {first, other} and "length" in reasons  # both ids really end rows
    result = run(model, prompts, route, eos=[first, other])
    assert_matches_oracle(result, tokens, reasons)


@pytest.mark.parametrize("route", ROUTES)
def test_eos_comes_from_the_models_generation_config_when_not_given(tiny_models, monkeypatch, route):
    model = tiny_models("tiny-qwen2")
    case = mixed_case(model, "tiny-qwen2")
    monkeypatch.setattr(model.generation_config, "eos_token_id", case.eos)
    tokens, reasons = oracle_batch(model, case.prompts, BUDGET)  # model.generate's own default
    assert tokens == case.tokens and "eos" in reasons
    result = run(model, case.prompts, route)
    assert_matches_oracle(result, case.tokens, case.reasons)


@pytest.mark.parametrize("route", ROUTES)
def test_empty_eos_list_disables_the_models_eos(tiny_models, monkeypatch, route):
    model = tiny_models("tiny-qwen2")
    case = mixed_case(model, "tiny-qwen2")
    tokens, reasons = oracle_batch(model, case.prompts, BUDGET, eos_token_id=[])
    assert set(reasons) == {"length"} and mismatches(tokens, case.tokens)  # case.eos would have fired
    monkeypatch.setattr(model.generation_config, "eos_token_id", case.eos)
    assert_matches_oracle(run(model, case.prompts, route, eos=[]), tokens, reasons)


@pytest.mark.parametrize("route", ROUTES)
def test_explicit_eos_replaces_the_models_eos(tiny_models, monkeypatch, route):
    model = tiny_models("tiny-qwen3")
    case = mixed_case(model, "tiny-qwen3")
    free_run = oracle_batch(model, case.prompts, BUDGET)[0]
    other = next(e for e in firing_eos_candidates(free_run) if cut_length_differs(free_run, e, case.eos))
    tokens, reasons = oracle_batch(model, case.prompts, BUDGET, eos_token_id=other)
    monkeypatch.setattr(model.generation_config, "eos_token_id", case.eos)
    assert_matches_oracle(run(model, case.prompts, route, eos=other), tokens, reasons)


def cut_length_differs(free_run: list[list[int]], eos: int, other: int) -> bool:
    return [cut_length(t, eos) for t in free_run] != [cut_length(t, other) for t in free_run]


# ---- profile -----------------------------------------------------------------------------------------


def kv_cache_bytes(model, rows: int, columns: int) -> int:
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return (2 * config.num_hidden_layers * rows * kv_heads * columns * head_dim + rows * columns) * element


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("route", CB_ROUTES)
def test_continuous_batching_profile_counts_match_the_schedule(tiny_models, route, arch):
    model = tiny_models(arch)
    case = mixed_case(model, arch)
    result = run(model, case.prompts, route, eos=case.eos, prefill_max_tokens=None)
    profile = result.profile
    admissions, decode_forwards, peak = simulate_schedule([len(t) for t in case.tokens], MIXED_ROWS)
    if route == "aligned":
        assert profile.prefill_groups == [[[i] for i in admitted] for admitted in admissions]
        assert profile.prefill_forwards == len(case.prompts)
    else:
        assert profile.prefill_groups == [[admitted] for admitted in admissions]
        assert profile.prefill_forwards == len(admissions)
    assert profile.decode_forwards == decode_forwards
    assert profile.max_active_rows == peak <= MIXED_ROWS
    assert profile.output_tokens == sum(len(t) for t in case.tokens)
    assert profile.cache_capacity >= max(MIXED_LENGTHS) + BUDGET - 1
    assert profile.kv_cache_bytes == kv_cache_bytes(model, MIXED_ROWS, profile.cache_capacity)
    assert profile.total_ms >= profile.prefill_ms + profile.decode_ms > 0
    assert profile.route == route


def test_ordinary_profile_counts_match_generate_batches(tiny_models):
    model = tiny_models("tiny-llama")
    case = mixed_case(model, "tiny-llama")
    profile = run(model, case.prompts, "ordinary", eos=case.eos).profile
    batches = [case.tokens[i : i + MIXED_ROWS] for i in range(0, len(case.tokens), MIXED_ROWS)]
    assert profile.prefill_forwards == len(batches)
    assert profile.decode_forwards == sum(max(len(t) for t in batch) - 1 for batch in batches)
    assert profile.output_tokens == sum(len(t) for t in case.tokens)
    assert profile.max_active_rows == MIXED_ROWS
    assert profile.kv_cache_bytes == 0 and profile.cache_capacity == 0
    assert profile.total_ms >= profile.prefill_ms + profile.decode_ms > 0


# ---- negative controls: a deliberately broken engine must fail the same oracle --------------------------


def test_control_wrong_prefill_positions_fail_the_oracle(tiny_models, monkeypatch):
    import autobucket.engine.batching.prefill

    correct = autobucket.engine.batching.prefill.positions_from_mask
    monkeypatch.setattr(autobucket.engine.batching.prefill, "positions_from_mask", lambda mask: correct(mask) + 1)
    for arch in ("tiny-llama", "tiny-gpt2"):  # rotary and learned absolute positions
        model = tiny_models(arch)
        case = mixed_case(model, arch)
        for route in CB_ROUTES:
            result = run(model, case.prompts, route, eos=case.eos)
            assert mismatches(result.tokens, case.tokens), f"{arch} {route}"


def test_control_wrong_decode_positions_fail_the_oracle(tiny_models, monkeypatch):
    model = tiny_models("tiny-qwen2")
    case = mixed_case(model, "tiny-qwen2")
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature the engine inspects
    def shifted(*args, **kwargs):
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        if ids is not None and ids.shape[1] == 1 and positions is not None:
            kwargs["position_ids"] = positions + 1
        return forward(*args, **kwargs)

    monkeypatch.setitem(model.__dict__, "forward", shifted)
    for route in CB_ROUTES:  # eager: a patched forward would make the compiled step retrace
        wrong = mismatches(run(model, case.prompts, route, eos=case.eos, compile=False).tokens, case.tokens)
        assert len(wrong) >= len(case.prompts) // 2, route


def test_control_attending_to_every_cache_column_fails_the_oracle(tiny_models, monkeypatch):
    model = tiny_models("tiny-llama")
    case = mixed_case(model, "tiny-llama")
    correct = StaticKVCache.step_mask
    monkeypatch.setattr(StaticKVCache, "step_mask", lambda self: torch.zeros_like(correct(self)))
    for route in CB_ROUTES:  # step_mask is the eager step's mask (tests/engine/compiled/test_compiled_decode.py: compiled)
        assert mismatches(run(model, case.prompts, route, eos=case.eos, compile=False).tokens, case.tokens), route


def test_control_trim_that_leaves_the_mask_behind_fails_the_oracle(tiny_models, monkeypatch):
    model = tiny_models("tiny-gpt2")
    case = mixed_case(model, "tiny-gpt2")
    correct = StaticKVCache.trim

    def trim_data_only(self):
        attend = self.attend.clone()
        dead = correct(self)
        self.attend.copy_(attend)  # K/V moved left, the mask did not
        return dead

    monkeypatch.setattr(StaticKVCache, "trim", trim_data_only)
    result = run(model, case.prompts, "aligned", eos=case.eos, trim_cache=True)
    assert result.profile.trims > 0
    assert mismatches(result.tokens, case.tokens)


def test_control_ordinary_route_without_padding_mask_fails_the_oracle(tiny_models, monkeypatch):
    import autobucket.engine.ordinary

    model = tiny_models("tiny-llama")
    case = mixed_case(model, "tiny-llama")
    correct = autobucket.engine.ordinary.left_pad

    def unmasked(*args, **kwargs):
        input_ids, attention_mask = correct(*args, **kwargs)
        return input_ids, torch.ones_like(attention_mask)

    monkeypatch.setattr(autobucket.engine.ordinary, "left_pad", unmasked)
    assert mismatches(run(model, case.prompts, "ordinary", eos=case.eos).tokens, case.tokens)


@pytest.mark.parametrize("route", ROUTES)
def test_control_penalty_left_out_fails_the_oracle(tiny_models, monkeypatch, route):
    import autobucket.engine.selection

    model = tiny_models("tiny-gpt2")
    prompts = mixed_prompts("tiny-gpt2")
    tokens, _ = oracle_batch(model, prompts, BUDGET, repetition_penalty=1.3)
    # every route selects through continuous.Selection (the ordinary route via a logits processor)
    monkeypatch.setattr(
        autobucket.engine.selection, "apply_repetition_penalty", lambda logits, seen, penalty: logits
    )
    assert mismatches(run(model, prompts, route, penalty=1.3).tokens, tokens)
