"""min_p, typical_p, epsilon_cutoff and eta_cutoff: `warp_logits` against transformers' own warpers in HF's
order, route invariance end to end, every sampled token inside HF's kept set (with a negative control
that samples without the warper), and one owner of sampling (SamplingConfig, never the model's
generation_config or a generate override)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_sampling import AUTO_COSTS, ROUTES, random_prompts
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.sampling.warpers import warp_logits
from autobucket.models import build_tiny_model

HF_ORDER = [TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
            EpsilonLogitsWarper, EtaLogitsWarper]  # fmt: skip
# One strong setting of each new warper for the tiny model (min_p 0.1 keeps ~30-120 of 1024 tokens).
WARPERS = [{"min_p": 0.1}, {"typical_p": 0.5}, {"epsilon_cutoff": 2e-3}, {"eta_cutoff": 3e-3}]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("tiny-llama", seed=3)


def hf_warpers(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0):
    """The oracle: transformers' own warpers, each added when transformers would add it, in HF_ORDER."""
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    if typical_p < 1.0:
        warpers.append(TypicalLogitsWarper(typical_p))
    if epsilon_cutoff:
        warpers.append(EpsilonLogitsWarper(epsilon_cutoff))
    if eta_cutoff:
        warpers.append(EtaLogitsWarper(eta_cutoff))
    return LogitsProcessorList(warpers)


def hf_warp(logits, **settings):
    return hf_warpers(**settings)(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.clone())


def ours(logits, temperature=1.0, top_k=0, top_p=1.0, **extra):
    return warp_logits(logits, temperature, top_k, top_p, **extra)


def assert_same_warp(got, want):
    """Same kept set, and the same renormalised distribution over it."""
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), (torch.isfinite(got) ^ torch.isfinite(want)).sum()
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1))


# ---------------------------------------------------------------- warp_logits against HF's warpers
def test_hf_builds_the_warpers_in_this_order(model):
    """HF's own `_get_logits_processor` (the order `generate` uses) is the order hf_warpers and warp_logits use."""
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.1, typical_p=0.9,
                              epsilon_cutoff=1e-3, eta_cutoff=1e-3)  # fmt: skip
    processors = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=1, encoder_input_ids=None, prefix_allowed_tokens_fn=None,
        logits_processor=None, device="cpu", model_kwargs={},
    )  # fmt: skip
    assert [type(p) for p in processors] == HF_ORDER


@pytest.mark.parametrize(
    "settings",
    [
        {"min_p": 0.05}, {"min_p": 0.3, "temperature": 0.7}, {"min_p": 1.0}, {"typical_p": 0.9},
        {"typical_p": 0.2, "temperature": 1.3}, {"epsilon_cutoff": 3e-3}, {"eta_cutoff": 2e-3},
        {"eta_cutoff": 0.5, "temperature": 2.0},
        # each warper sees the previous one's survivors: interactions, in HF's order
        {"top_k": 40, "min_p": 0.2}, {"top_p": 0.8, "typical_p": 0.7}, {"top_k": 50, "epsilon_cutoff": 1e-2},
        {"temperature": 0.8, "top_k": 100, "top_p": 0.9, "min_p": 0.05, "typical_p": 0.95, "epsilon_cutoff": 1e-3,
         "eta_cutoff": 1e-3},
    ],
)  # fmt: skip
@pytest.mark.parametrize("scale", [1.0, 4.0])  # flat and peaked distributions
def test_warp_equals_hf_warpers(settings, scale):
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(17)) * scale
    logits[0, :10] = logits[0].max()  # ties at the top
    assert_same_warp(ours(logits, **settings), hf_warp(logits, **settings))


def test_every_warper_can_tell_a_wrong_warp():
    """Negative control: dropping the warper, or applying two in the other order, fails the comparison."""
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(17)) * 2.0
    for settings in WARPERS:
        with pytest.raises(AssertionError):
            assert_same_warp(ours(logits), hf_warp(logits, **settings))
    # epsilon's cut is absolute, so it keeps more after top-k's renormalisation than before it
    reversed_order = hf_warpers(top_k=40)(None, hf_warpers(epsilon_cutoff=1e-2)(None, logits.clone()))
    with pytest.raises(AssertionError):
        assert_same_warp(ours(logits, top_k=40, epsilon_cutoff=1e-2), reversed_order)


def test_warpers_always_keep_a_token():
    logits = torch.full((2, 50), -30.0)
    logits[:, 7] = 30.0  # one token holds all the mass: every warper keeps exactly it
    for settings in [*WARPERS, {"typical_p": 1e-6}, {"min_p": 1.0}]:
        assert_same_warp(ours(logits, **settings), hf_warp(logits, **settings))
        assert torch.isfinite(ours(logits, **settings)).sum(-1).tolist() == [1, 1]


# ---------------------------------------------------------------- end to end
def generate(model, route, prompts, settings):
    return Rollout(model, config=RolloutConfig(route=route, costs=AUTO_COSTS)).generate(prompts, settings)


@pytest.mark.parametrize("warper", WARPERS, ids=lambda w: next(iter(w)))
def test_warped_sampling_is_route_invariant(model, warper):
    prompts = random_prompts([5, 17, 3, 30, 9])
    settings = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=11, logprobs=True, continuous_batch_size=3,
                              **warper)  # fmt: skip
    results = {route: generate(model, route, prompts, settings) for route in ROUTES}
    assert results["auto"].route == "bucketed"  # 5 rows over a batch of 3: CB
    for route, result in results.items():
        assert result.tokens == results["ordinary"].tokens, route
        for got, want in zip(result.logprobs, results["ordinary"].logprobs, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4)
    unwarped = generate(model, "aligned", prompts, SamplingConfig(max_new_tokens=8, temperature=1.0, seed=11))
    assert unwarped.tokens != results["aligned"].tokens, "the warper changed nothing: weak setting"


def tokens_outside_hf_kept_set(model, prompts, tokens, warper) -> int:
    """How many sampled tokens HF's warpers (on a teacher-forced forward's logits) would have filtered."""
    outside = 0
    for prompt, samples in zip(prompts, tokens, strict=True):
        for sample in samples:
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + sample])).logits[0, len(prompt) - 1 : -1].float()
            kept = torch.isfinite(hf_warp(logits, **warper))  # [steps, vocab]
            outside += int((~kept[torch.arange(len(sample)), torch.tensor(sample)]).sum())
    return outside


@pytest.mark.parametrize("route", ["ordinary", "aligned"])
@pytest.mark.parametrize("warper", WARPERS, ids=lambda w: next(iter(w)))
def test_sampled_tokens_stay_in_hf_kept_set(model, warper, route):
    prompts = random_prompts([6, 13, 4], seed=2)
    base = dict(max_new_tokens=16, temperature=1.0, n=4, eos_token_id=[], seed=5)
    result = generate(model, route, prompts, SamplingConfig(**base, **warper))
    assert sum(len(s) for samples in result.tokens for s in samples) == 3 * 4 * 16
    assert tokens_outside_hf_kept_set(model, prompts, result.tokens, warper) == 0
    # negative control: the same draws without the warper leave HF's kept set
    skipped = generate(model, route, prompts, SamplingConfig(**base))
    assert tokens_outside_hf_kept_set(model, prompts, skipped.tokens, warper) > 0


# ---------------------------------------------------------------- one owner
def test_model_generation_config_sampling_values_are_not_used(model):
    """A model whose generation_config samples (and penalises) generates exactly what SamplingConfig says."""
    tuned_values = dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.1, typical_p=0.9, epsilon_cutoff=1e-3,
                        eta_cutoff=1e-3, repetition_penalty=1.3)  # fmt: skip
    tuned = copy.deepcopy(model)
    tuned.generation_config.update(do_sample=True, **tuned_values)
    prompts = random_prompts([7, 12])
    sampled = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=4)
    for settings in (SamplingConfig(max_new_tokens=8), sampled):
        for route in ("ordinary", "aligned"):
            assert generate(tuned, route, prompts, settings).tokens == generate(model, route, prompts, settings).tokens
    # negative controls: those values change the tokens when given through SamplingConfig, and HF's own
    # generate applies them
    as_sampling = SamplingConfig(max_new_tokens=8, seed=4, **tuned_values)
    assert generate(model, "aligned", prompts, as_sampling).tokens != generate(model, "aligned", prompts, sampled).tokens
    ids = torch.tensor([prompts[1]])
    hf_greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    with torch.random.fork_rng():  # HF samples from the global generator: seed it here, restore it after
        torch.manual_seed(0)
        hf_tuned = tuned.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8)
    assert not torch.equal(hf_greedy, hf_tuned)


@pytest.mark.parametrize(
    ("option", "value"),
    [("min_p", 0.1), ("typical_p", 0.9), ("epsilon_cutoff", 1e-3), ("eta_cutoff", 1e-3), ("temperature", 0.7),
     ("top_k", 5), ("top_p", 0.9)],
)  # fmt: skip
def test_sampling_overrides_point_to_sampling_config(model, option, value):
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    with pytest.raises(ValueError, match=rf"'{option}' must be set in SamplingConfig.*SamplingConfig\({option}="):
        rollout.generate(random_prompts([4]), SamplingConfig(max_new_tokens=2), **{option: value})
    assert len(rollout.generate(random_prompts([4]), SamplingConfig(max_new_tokens=2)).tokens) == 1


def test_unimplemented_warper_override_is_rejected(model):
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    with pytest.raises(ValueError, match=r"top_h=0\.5 is not supported by autobucket's sampler"):
        rollout.generate(random_prompts([4]), SamplingConfig(max_new_tokens=2), top_h=0.5)
