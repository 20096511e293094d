"""`SamplingConfig(min_new_tokens=...)`: EOS cannot be chosen before a request has that many new tokens.

Oracles: single-request HF `generate(min_new_tokens=k)` (transformers' MinNewTokensLengthLogitsProcessor)
with an EOS id that greedy decoding emits early for some prompts, so the setting changes their tokens
(asserted: a test where it changed nothing could not fail); HF's processor itself on the same scores;
and, for trainer-mode logprobs, a teacher-forced forward of the whole sequence (the mask shapes what is
chosen, not the trainer's logprob of it)."""

from __future__ import annotations

import pytest
import torch
from oracles import oracle_batch, oracle_generate, teacher_forced_logprobs
from transformers import MinNewTokensLengthLogitsProcessor
from workloads import ARCHS, random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.sampling.streams import request_seeds
from autobucket.engine.selection import SamplerSettings, Selection

pytestmark = pytest.mark.engine

MAX_NEW = 16
LENGTHS = (5, 17, 2, 30, 9, 23)
ROUTE_CASES = ("ordinary", "equal_width", "aligned", "auto")


def hf_generate(model, prompt, eos, min_new_tokens):
    """Single-request greedy HF generate with min_new_tokens: new tokens through the first EOS."""
    return oracle_generate(model, prompt, MAX_NEW, eos_token_id=eos, min_new_tokens=min_new_tokens)[0]


def early_eos_case(model):
    """Prompts, an EOS id greedy emits for some prompts and not others, and a minimum past its first firing."""
    prompts = random_prompts(LENGTHS, seed=3)
    free, _ = oracle_batch(model, prompts, MAX_NEW, eos_token_id=[])
    ends = {}
    for eos in {t for tokens in free for t in tokens}:
        firsts = [tokens.index(eos) for tokens in free if eos in tokens]
        if 0 < len(firsts) < len(prompts) and min(firsts) < MAX_NEW - 3:
            ends[eos] = min(firsts)
    assert ends, "no token ends some greedy completions early: change the prompts"
    eos = min(ends, key=lambda token: (ends[token], token))
    return prompts, eos, ends[eos] + 2  # the earliest firing row must generate past it


@pytest.mark.parametrize("route", ROUTE_CASES)
@pytest.mark.parametrize("model_name", ARCHS)
def test_greedy_requests_generate_at_least_the_minimum_as_hf_generate_does(tiny_models, model_name, route):
    model = tiny_models(model_name)
    prompts, eos, minimum = early_eos_case(model)
    without = [hf_generate(model, p, eos, 0) for p in prompts]
    expected = [hf_generate(model, p, eos, minimum) for p in prompts]
    assert expected != without, "the minimum must change some completion, else this test could not fail"
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=eos, min_new_tokens=minimum, continuous_batch_size=4)
    result = Rollout(model, config=RolloutConfig(route=route)).generate(prompts, sampling)
    assert result.tokens == expected
    assert all(len(tokens) >= minimum for tokens in result.tokens)


@pytest.mark.parametrize("route", ["ordinary", "aligned"])
def test_the_minimum_with_a_repetition_penalty_is_hfs_processors_in_hfs_order(tiny_models, route):
    """Penalty first, then the EOS mask, as HF's processors run (the mask writes the penalty's own output,
    not a copy of it). Oracle: single-request HF generate with both."""
    model = tiny_models("tiny-llama")
    prompts, eos, minimum = early_eos_case(model)

    def oracle(minimum_new: int) -> list[list[int]]:
        return [
            oracle_generate(model, p, MAX_NEW, repetition_penalty=1.3, eos_token_id=eos, min_new_tokens=minimum_new)[0]
            for p in prompts
        ]

    expected = oracle(minimum)
    assert expected != oracle(0), "the minimum must change some completion under the penalty"
    sampling = SamplingConfig(
        max_new_tokens=MAX_NEW, eos_token_id=eos, min_new_tokens=minimum, repetition_penalty=1.3, continuous_batch_size=4
    )
    assert Rollout(model, config=RolloutConfig(route=route)).generate(prompts, sampling).tokens == expected


def test_the_mask_is_hfs_processor_and_leaves_the_callers_logits_alone():
    """Rows at steps 0, k - 1, k and k + 3 of a call: the masked scores equal HF's processor at each row's
    length, and the raw logits (what trainer-mode logprobs read) are not written."""
    eos, minimum, vocab = (7, 11), 4, 32
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    selection = Selection(SamplerSettings(0.0, 0, 1.0, (0,)), 1.0, False, eos_token_ids=eos, min_new_tokens=minimum)
    steps = [0, minimum - 1, minimum, minimum + 3]
    masked = selection._without_early_eos(logits, steps)
    processor = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=5, min_new_tokens=minimum, eos_token_id=list(eos))
    for row, step in enumerate(steps):
        theirs = processor(torch.zeros((1, 5 + step), dtype=torch.long), logits[row : row + 1].clone())
        assert torch.equal(masked[row : row + 1], theirs), f"row {row} (step {step})"
    assert torch.equal(logits, raw)


@pytest.mark.parametrize("route", ["aligned", "auto"])
def test_sampled_requests_keep_the_minimum_and_do_not_depend_on_their_batch(tiny_models, route):
    """Sampled, n = 2 with refill, invariant kernels, many EOS ids so rows end early without a minimum: with
    one, no row ends before it, each request equals itself alone (tokens and logprobs, bitwise), and the
    trainer-mode logprobs are a teacher-forced forward's (the mask does not enter them)."""
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts(LENGTHS, seed=4)
    seeds = list(request_seeds(9, len(prompts)))
    eos = list(range(3, 203))  # 200 of the 1,024 ids: a sampled row ends within a few tokens
    common = {"max_new_tokens": MAX_NEW, "temperature": 1.0, "n": 2, "logprobs": True, "eos_token_id": eos}
    rollout = Rollout(model, config=RolloutConfig(route=route, kernels="invariant"))
    free = rollout.generate(prompts, SamplingConfig(seed=seeds, **common))
    assert min(len(t) for sample in free.tokens for t in sample) < 4, "rows must end early without a minimum"
    kept = rollout.generate(prompts, SamplingConfig(seed=seeds, min_new_tokens=4, continuous_batch_size=5, **common))
    assert min(len(t) for sample in kept.tokens for t in sample) >= 4
    for i, prompt in enumerate(prompts):
        alone = rollout.generate([prompt], SamplingConfig(seed=[seeds[i]], min_new_tokens=4, **common))
        assert (kept.tokens[i], kept.logprobs[i]) == (alone.tokens[0], alone.logprobs[0]), f"prompt {i}"
    tokens, logprobs = kept.tokens[0][0], kept.logprobs[0][0]
    forced = teacher_forced_logprobs(model, prompts[0], tokens)
    torch.testing.assert_close(torch.tensor(logprobs), forced, rtol=0, atol=1e-5)


@pytest.mark.parametrize("route", ROUTE_CASES)
def test_none_takes_the_models_value_and_zero_turns_it_off(tiny_models, monkeypatch, route):
    """On every route (transformers 5.x refills a None field of the config `generate` is given from the
    model's own: the ordinary route once kept masking EOS to the model's minimum)."""
    model = tiny_models("tiny-llama")
    prompts, eos, minimum = early_eos_case(model)
    rollout = Rollout(model, config=RolloutConfig(route=route))
    with monkeypatch.context() as patch:
        patch.setattr(model.generation_config, "min_new_tokens", minimum)
        from_model = rollout.generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=eos))
        off = rollout.generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=eos, min_new_tokens=0))
    assert from_model.tokens == [hf_generate(model, p, eos, minimum) for p in prompts]
    assert off.tokens == [hf_generate(model, p, eos, 0) for p in prompts] != from_model.tokens


def test_bad_values_are_refused(tiny_models):
    model = tiny_models("tiny-llama")
    prompts = random_prompts(LENGTHS, seed=3)
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    for value in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match=rf"min_new_tokens={value!r} is invalid"):
            SamplingConfig(min_new_tokens=value)
    with pytest.raises(ValueError, match="min_new_tokens"):
        rollout.generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW), min_new_tokens=3)  # SamplingConfig's


def test_the_cli_flag_applies_it_as_the_api_does(tiny_models, tmp_path, capsys):
    import json

    from autobucket.cli import main
    from autobucket.models import build_tiny_model, load_model

    prompts, eos, minimum = early_eos_case(tiny_models("tiny-llama"))
    folder = tmp_path / "model"
    saved = build_tiny_model("tiny-llama")  # a fresh copy: the CLI takes EOS from the saved generation config
    saved.generation_config.eos_token_id = eos
    saved.save_pretrained(folder)
    capsys.readouterr()  # what saving logged is not the command's
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    argv = ["generate", "--model", str(folder), "--prompts", str(path), "--max-new-tokens", str(MAX_NEW),
            "--route", "aligned", "--quiet", "--min-new-tokens", str(minimum)]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    model, _ = load_model(str(folder))
    expected = [hf_generate(model, p, eos, minimum) for p in prompts]
    assert [row["tokens"] for row in rows] == expected != [hf_generate(model, p, eos, 0) for p in prompts]


def test_the_cli_flag_turns_the_models_own_minimum_off_with_zero(tiny_models, tmp_path, capsys):
    """A saved model whose generation config sets min_new_tokens: the CLI applies it by default and
    `--min-new-tokens 0` turns it off, each as HF generate does with that minimum."""
    import json

    from autobucket.cli import main
    from autobucket.models import build_tiny_model, load_model

    prompts, eos, minimum = early_eos_case(tiny_models("tiny-llama"))
    folder = tmp_path / "model"
    saved = build_tiny_model("tiny-llama")
    saved.generation_config.eos_token_id, saved.generation_config.min_new_tokens = eos, minimum
    saved.save_pretrained(folder)
    capsys.readouterr()
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    model, _ = load_model(str(folder))
    for flag, applied in (([], minimum), (["--min-new-tokens", "0"], 0)):
        argv = ["generate", "--model", str(folder), "--prompts", str(path), "--max-new-tokens", str(MAX_NEW),
                "--route", "aligned", "--quiet", *flag]  # fmt: skip
        assert main(argv) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [row["tokens"] for row in rows] == [hf_generate(model, p, eos, applied) for p in prompts]
    assert [hf_generate(model, p, eos, 0) for p in prompts] != [hf_generate(model, p, eos, minimum) for p in prompts]
    assert main(["generate", "--model", str(folder), "--prompts", str(path), "--min-new-tokens", "-1"]) == 2
    assert "expected an integer >= 0, got '-1'" in capsys.readouterr().err
