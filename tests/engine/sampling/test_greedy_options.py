"""Options that only act when sampling, given with greedy decoding (temperature 0): refused by name rather
than silently ignored, as the CLI refuses them and HF refuses greedy `num_return_sequences > 1`.

Oracles: the refusal names the field, its value and the fix (temperature > 0); `greedy_copies=True`
opts in to n identical greedy samples, each HF's greedy answer; the same n with temperature > 0 gives
samples that differ (the control: what a GRPO user who forgot the temperature was silently missing).
A seed is accepted when greedy and changes nothing (trainers set one for the whole run)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from oracles import oracle_batch
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

SAMPLING_ONLY = {"top_k": 40, "top_p": 0.9, "min_p": 0.1, "typical_p": 0.9, "epsilon_cutoff": 1e-3, "eta_cutoff": 1e-3}
BUDGET = 6


@pytest.mark.parametrize(("name", "value"), SAMPLING_ONLY.items())
def test_a_sampling_only_option_with_greedy_decoding_is_refused_naming_it_and_the_fix(name, value):
    with pytest.raises(ValueError) as refused:
        SamplingConfig(**{name: value})
    message = str(refused.value)
    assert f"{name}={value!r} only act when sampling" in message
    assert "set temperature > 0 (e.g. temperature=1.0) to sample" in message
    assert getattr(SamplingConfig(temperature=1.0, **{name: value}), name) == value  # sampling: accepted


def test_every_ignored_option_is_named_at_once():
    with pytest.raises(ValueError, match=re.escape("top_k=40, top_p=0.9 only act when sampling")):
        SamplingConfig(n=4, top_k=40, top_p=0.9)


@pytest.mark.parametrize("make", [
    lambda: SamplingConfig(n=4),
    lambda: SamplingConfig(n=4, temperature=0.0),
    lambda: dataclasses.replace(SamplingConfig(), n=4),
])  # fmt: skip
def test_greedy_n_above_one_is_refused_unless_copies_are_asked_for(make):
    with pytest.raises(ValueError) as refused:
        make()
    message = str(refused.value)
    assert "n=4 with temperature=0.0 (greedy) gives 4 identical samples of every prompt" in message
    assert "set temperature > 0" in message and "greedy_copies=True" in message


def test_greedy_copies_is_validated_and_has_no_effect_when_sampling():
    with pytest.raises(ValueError, match="greedy_copies='yes'"):
        SamplingConfig(n=2, greedy_copies="yes")
    assert SamplingConfig(n=2, temperature=1.0, greedy_copies=True).n == 2


@pytest.mark.engine
@pytest.mark.parametrize("route", ["ordinary", "aligned"])
def test_greedy_copies_are_each_hfs_greedy_answer_and_sampling_spreads_them(tiny_models, route):
    model = tiny_models("tiny-llama")
    prompts = random_prompts([9, 14], seed=31)
    expected, _ = oracle_batch(model, prompts, BUDGET, eos_token_id=[])
    rollout = Rollout(model, config=RolloutConfig(route=route))
    copies = rollout.generate(prompts, SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], n=3, greedy_copies=True))
    assert copies.tokens == [[answer] * 3 for answer in expected]
    sampled = rollout.generate(prompts, SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], n=3, temperature=1.0))
    assert all(len({tuple(sample) for sample in samples}) > 1 for samples in sampled.tokens)


@pytest.mark.engine
def test_a_seed_with_greedy_decoding_is_accepted_and_changes_nothing(tiny_models):
    model = tiny_models("tiny-llama")
    prompts = random_prompts([9, 14], seed=31)
    expected, _ = oracle_batch(model, prompts, BUDGET, eos_token_id=[])
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    for seed in (0, 5, [3, 4]):
        assert rollout.generate(prompts, SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[], seed=seed)).tokens == expected


def test_the_api_refuses_what_the_cli_refuses(capsys, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("1 2 3\n")
    assert main(["generate", "--model", "tiny-llama", "--prompts", str(path), "--n", "4", "--top-p", "0.9"]) == 2
    assert "--temperature" in capsys.readouterr().err
    with pytest.raises(ValueError, match="temperature > 0"):
        SamplingConfig(n=4, top_p=0.9)
    # a warper the CLI has no flag for, through --generation-option: the config's own refusal, in flags
    assert main(["generate", "--model", "tiny-llama", "--prompts", str(path), "--generation-option", "min_p=0.1"]) == 2
    assert "min_p=0.1 only act when sampling, and --temperature 0.0 is greedy decoding" in capsys.readouterr().err
