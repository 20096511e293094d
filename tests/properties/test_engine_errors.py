"""Bad input fails early with a ValueError that names the field (and the prompt), and the same
`Rollout` still generates oracle-exact tokens on the next call."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch
from oracles import assert_matches_oracle, hf_greedy, oracle_batch
from workloads import ROUTES, random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_thread")]

GOOD_PROMPTS = random_prompts([5, 8, 2], seed=3)
BUDGET = 6


@pytest.fixture
def model(tiny_models):
    return tiny_models("tiny-qwen2")


def sampling(**kwargs) -> SamplingConfig:
    return SamplingConfig(**{"max_new_tokens": BUDGET, "continuous_batch_size": 2, **kwargs})


def assert_still_exact(rollout: Rollout) -> None:
    tokens, reasons = oracle_batch(rollout.model, GOOD_PROMPTS, BUDGET)
    assert_matches_oracle(rollout.generate(GOOD_PROMPTS, sampling()), tokens, reasons)


# ---- prompts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_no_prompts_give_an_empty_result(model, route):
    rollout = Rollout(model, config=RolloutConfig(route=route))
    result = rollout.generate([], sampling())
    assert result.tokens == [] and result.finish_reasons == [] and result.route == route
    assert result.profile.output_tokens == 0
    assert result.to_padded(0)[0].shape == (0, 0)
    assert_still_exact(rollout)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([[5, 6], [], [7]], "prompt 1 is empty"),
        ([[5, 6], [7, 1024]], "prompt 1 has token id 1024 outside the vocabulary"),
        ([[5, -1]], "prompt 0 has token id -1 outside the vocabulary"),
        ([[5, 6], [7], [8, 2.0]], "prompt 2 has token id 2.0, a float: token ids are integers"),
        ([[5, True]], "prompt 0 has token id True, a bool"),
        ([[5, 6], torch.tensor([[1, 2]])], "prompt 1 must be a 1-D integer tensor"),
        ([[5, 6], np.array([[1, 2]])], "prompt 1 must be a 1-D integer array, got shape (1, 2)"),
        ([np.array([1.0, 2.0])], "prompt 0 must be a 1-D integer array, got shape (2,) and dtype float64"),
        ([torch.tensor([1.0, 2.0])], "prompt 0 must be a 1-D integer tensor, got shape (2,) and dtype torch.float32"),
        ([np.array([5, 1024])], "prompt 0 has token id 1024 outside the vocabulary"),
        ([[5], "hello"], "prompt 1 is a string but the Rollout has no tokenizer"),
        ("hello", "prompts must be a list"),
        (torch.tensor([[5, 6]]), "pass list(input_ids) when its rows have no padding, or generate_padded"),
        (np.array([[5, 6]]), "prompts is a 2-D ndarray of shape (1, 2)"),
        (torch.tensor([5, 6]), "prompts must be a list"),
    ],
)
@pytest.mark.parametrize("route", ["ordinary", "aligned"])
def test_bad_prompt_is_rejected_naming_its_index(model, route, prompts, message):
    rollout = Rollout(model, config=RolloutConfig(route=route))
    with pytest.raises(ValueError, match=re.escape(message)):
        rollout.generate(prompts, sampling())
    assert_still_exact(rollout)


def test_numpy_prompts_run_as_the_same_token_ids(model):
    # what a `datasets` column in numpy format hands over: integer arrays, or lists of numpy integers
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    as_arrays = [np.array(prompt, dtype=np.int64) for prompt in GOOD_PROMPTS]
    as_numpy_ints = [[np.int32(token) for token in prompt] for prompt in GOOD_PROMPTS]
    tokens, reasons = oracle_batch(model, GOOD_PROMPTS, BUDGET)
    for prompts in (as_arrays, as_numpy_ints):
        result = rollout.generate(prompts, sampling())
        assert_matches_oracle(result, tokens, reasons)
        assert all(type(token) is int for row in result.tokens for token in row)


def bos_adding_tokenizer():
    """The shared byte-level BPE tokenizer with a Llama-style post-processor: `tokenizer(text)` prepends <s>."""
    import copy

    from byte_tokenizer import byte_bpe_tokenizer
    from tokenizers.processors import TemplateProcessing

    tokenizer = copy.deepcopy(byte_bpe_tokenizer())
    bos = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return tokenizer, bos


def test_string_prompts_get_one_bos_whether_or_not_a_chat_template_wrote_it(model):
    """Plain text is tokenized as `tokenizer(text)` (its BOS added); text that already begins with the BOS
    token, as `apply_chat_template(..., tokenize=False)` writes it for Llama, Gemma or Mistral, is not
    given a second one (TRL tokenizes templated prompts without special tokens for the same reason)."""
    tokenizer, bos = bos_adding_tokenizer()
    text = "abc dep ghop"
    plain_ids = tokenizer(text)["input_ids"]
    assert plain_ids[0] == bos and plain_ids[1] != bos
    templated = "<s>" + text
    assert tokenizer(templated)["input_ids"][:2] == [bos, bos]  # control: what adding them again gives
    rollout = Rollout(model, tokenizer, RolloutConfig(route="aligned"))
    tokens, reasons = oracle_batch(model, [plain_ids], BUDGET)
    for prompt in (text, templated):
        assert_matches_oracle(rollout.generate([prompt], sampling()), tokens, reasons)


@pytest.mark.parametrize("route", ROUTES)
def test_prompt_longer_than_the_context_is_rejected_and_the_boundary_is_accepted(model, route):
    # tiny models have 2048 positions; the check allows prompt + max_new_tokens <= 2048
    rollout = Rollout(model, config=RolloutConfig(route=route, prefill_max_tokens=None))
    too_long = random_prompts([3, 4, 2047], seed=4)
    with pytest.raises(ValueError, match=r"prompt 2 has 2047 tokens.*max_new_tokens=2.*2048"):
        rollout.generate(too_long, sampling(max_new_tokens=2))
    fits = random_prompts([3, 2046], seed=4)
    tokens, reasons = oracle_batch(model, fits, 2)
    assert_matches_oracle(rollout.generate(fits, sampling(max_new_tokens=2)), tokens, reasons)


def test_prompt_longer_than_one_prefill_forward_is_chunked_not_rejected(model):
    # prefill_max_tokens is a budget: the 9-token prompt takes two chunks (tests/engine/batching/test_prefill_forms.py)
    rollout = Rollout(model, config=RolloutConfig(route="aligned", prefill_max_tokens=8))
    prompts = random_prompts([3, 9], seed=5)
    tokens, reasons = oracle_batch(model, prompts, sampling().max_new_tokens)
    result = rollout.generate(prompts, sampling())
    assert_matches_oracle(result, tokens, reasons)
    assert result.profile.prefill_forms == [["padded", "chunked"]] and result.profile.prefill_forwards == 3


@pytest.mark.parametrize("route", ROUTES)
def test_generate_padded_rejects_a_mask_that_is_not_left_padded(model, route):
    rollout = Rollout(model, config=RolloutConfig(route=route))
    input_ids = torch.tensor([[0, 5, 6], [7, 8, 0]])
    with pytest.raises(ValueError, match=r"row 1 of attention_mask is right-padded \(ones, then zeros\): pad on the left"):
        rollout.generate_padded(input_ids, torch.tensor([[0, 1, 1], [1, 1, 0]]), sampling())
    with pytest.raises(ValueError, match=r"row 0 of attention_mask is not left-padded \(zeros, then ones\): \[1, 0, 1\]"):
        rollout.generate_padded(input_ids, torch.tensor([[1, 0, 1], [1, 1, 1]]), sampling())
    with pytest.raises(ValueError, match=r"row 0 of attention_mask is not left-padded \(zeros, then ones\): \[0, 2, 1\]"):
        rollout.generate_padded(input_ids, torch.tensor([[0, 2, 1], [1, 1, 1]]), sampling())
    with pytest.raises(ValueError, match="row 1 of attention_mask has no ones: every row needs at least one prompt token"):
        rollout.generate_padded(input_ids, torch.tensor([[0, 1, 1], [0, 0, 0]]), sampling())
    with pytest.raises(ValueError, match="same 2-D"):
        rollout.generate_padded(input_ids, torch.ones(2, 2, dtype=torch.long), sampling())
    with pytest.raises(ValueError, match=r"input_ids must hold integer token ids, got dtype torch\.float32"):
        rollout.generate_padded(input_ids.float(), torch.tensor([[0, 1, 1], [1, 1, 1]]), sampling())
    assert_still_exact(rollout)


def test_generate_padded_takes_numpy_arrays(model):
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    width = max(len(prompt) for prompt in GOOD_PROMPTS)
    input_ids = np.zeros((len(GOOD_PROMPTS), width), dtype=np.int64)
    attention_mask = np.zeros_like(input_ids)
    for row, prompt in enumerate(GOOD_PROMPTS):
        input_ids[row, width - len(prompt) :] = prompt
        attention_mask[row, width - len(prompt) :] = 1
    tokens, reasons = oracle_batch(model, GOOD_PROMPTS, BUDGET)
    assert_matches_oracle(rollout.generate_padded(input_ids, attention_mask, sampling()), tokens, reasons)


# ---- generation options ------------------------------------------------------------------------------

UNSUPPORTED = [
    ("num_beams", 2),
    ("forced_eos_token_id", 3),  # forces EOS at HF's batch-wide max_length, which no per-request budget has
    ("guidance_scale", 1.5),
    ("output_scores", True),
    ("return_dict_in_generate", True),
    ("token_healing", True),  # HF rewrites the prompt's last tokens: generating without it would differ
]


@pytest.mark.parametrize(("option", "value"), UNSUPPORTED)
@pytest.mark.parametrize("route", ROUTES)
def test_unsupported_generate_override_is_rejected(model, route, option, value):
    rollout = Rollout(model, config=RolloutConfig(route=route))
    with pytest.raises(ValueError, match=f"{option}={value!r}"):
        rollout.generate(GOOD_PROMPTS, sampling(), **{option: value})
    assert_still_exact(rollout)


@pytest.mark.parametrize(("option", "value"), UNSUPPORTED)
def test_unsupported_option_in_the_models_generation_config_is_rejected(model, monkeypatch, option, value):
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    with monkeypatch.context() as patch:
        patch.setattr(model.generation_config, option, value)
        with pytest.raises(ValueError, match=f"{option}={value!r}.*model's generation_config"):
            rollout.generate(GOOD_PROMPTS, sampling())
    assert_still_exact(rollout)


@pytest.mark.parametrize(("option", "value"), [("forced_eos_token_id", 3), ("no_repeat_ngram_size", 1)])
@pytest.mark.parametrize("route", ROUTES)
def test_an_option_of_the_models_generation_config_unset_as_the_refusal_says_is_off(
    model, monkeypatch, route, option, value
):
    """The refusal says `option=None`, and then no route applies the model's value. transformers 5.x
    refills a None field of the config `generate` is given from the model's own at every call, so the
    ordinary route applied it anyway. Control: the option does change these completions."""
    assert hf_greedy(model, GOOD_PROMPTS, BUDGET, **{option: value}) != hf_greedy(model, GOOD_PROMPTS, BUDGET), (
        "a weak case"
    )
    tokens, reasons = oracle_batch(model, GOOD_PROMPTS, BUDGET)  # the model without the option
    with monkeypatch.context() as patch:
        patch.setattr(model.generation_config, option, value)
        result = Rollout(model, config=RolloutConfig(route=route)).generate(GOOD_PROMPTS, sampling(), **{option: None})
    assert_matches_oracle(result, tokens, reasons)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"foo": 1}, r"unknown generate option\(s\) \['foo'\]"),
        ({"do_sample": True}, "do_sample=True"),
        ({"max_new_tokens": 3}, "'max_new_tokens' must be set in SamplingConfig"),
        ({"temperature": 0.5}, "'temperature' must be set in SamplingConfig"),
        ({"eos_token_id": 3}, "'eos_token_id' must be set in SamplingConfig"),
        ({"repetition_penalty": 1.2}, "'repetition_penalty' must be set in SamplingConfig"),
        # HF lets max_new_tokens win over max_length: as an override it would do nothing
        ({"max_length": 5}, r"max_length=5 is not an override here: the budget is SamplingConfig\(max_new_tokens"),
    ],
)
def test_bad_generate_overrides_are_rejected(model, overrides, message):
    rollout = Rollout(model, config=RolloutConfig(route="equal_width"))
    with pytest.raises(ValueError, match=message):
        rollout.generate(GOOD_PROMPTS, sampling(), **overrides)
    assert_still_exact(rollout)


@pytest.mark.parametrize(
    ("option", "value"),
    [("do_sample", True), ("temperature", 0.7), ("top_k", 5), ("repetition_penalty", 1.5)],
)
@pytest.mark.parametrize("route", ROUTES)
def test_sampling_settings_in_the_models_generation_config_do_not_change_greedy_tokens(
    model, monkeypatch, route, option, value
):
    # Real instruct checkpoints ship do_sample=True, a temperature, top_k and a repetition penalty in
    # their generation_config; SamplingConfig is the one source of truth, so greedy stays greedy.
    rollout = Rollout(model, config=RolloutConfig(route=route))
    tokens, reasons = oracle_batch(model, GOOD_PROMPTS, BUDGET)  # explicit greedy, penalty 1.0
    monkeypatch.setattr(model.generation_config, option, value)
    assert_matches_oracle(rollout.generate(GOOD_PROMPTS, sampling()), tokens, reasons)


def test_eos_outside_the_vocabulary_is_rejected(model):
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))  # the old default, what this test ran
    with pytest.raises(ValueError, match="eos_token_id 5000 is outside the vocabulary"):
        rollout.generate(GOOD_PROMPTS, sampling(eos_token_id=[3, 5000]))
    assert_still_exact(rollout)


# ---- config validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"max_new_tokens": 2.0}, "max_new_tokens=2.0"),
        ({"continuous_batch_size": 0}, "continuous_batch_size=0"),
        ({"continuous_batch_size": True}, "continuous_batch_size=True"),
        ({"repetition_penalty": 0}, "repetition_penalty=0"),
        ({"repetition_penalty": -1.3}, "repetition_penalty=-1.3"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty=nan"),
        ({"temperature": -0.7}, "temperature=-0.7"),
        ({"eos_token_id": -1}, "eos_token_id=-1"),
        ({"eos_token_id": "2"}, "eos_token_id='2'"),
        ({"eos_token_id": True}, "eos_token_id=True"),
        ({"eos_token_id": [2, None]}, r"eos_token_id=\[2, None\]"),
    ],
)
def test_bad_sampling_config_is_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def test_a_model_whose_weights_were_never_loaded_is_named_at_construction(tiny_models):
    import copy

    meta = copy.deepcopy(tiny_models("tiny-qwen2")).to("meta")
    with pytest.raises(ValueError, match="parameter 'model.embed_tokens.weight' is on the meta device"):
        Rollout(meta)


def test_to_padded_names_a_missing_pad_id(model):
    result = Rollout(model).generate(GOOD_PROMPTS, sampling())
    # GPT-2's and Llama's tokenizers have pad_token_id None: the README's to_padded(pad_id=tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="pad_id=None is invalid: pass an int token id .this tokenizer has no pad"):
        result.to_padded(pad_id=None)
    with pytest.raises(ValueError, match="pad_id='0' is invalid"):
        result.to_padded(pad_id="0")
    responses, mask = result.to_padded(pad_id=np.int64(7))
    assert responses[mask == 0].eq(7).all() and mask.sum().item() == sum(map(len, result.tokens))


def test_numpy_sampling_values_are_stored_as_plain_python_values():
    # what a sweep over np.arange / a numpy config hands over; the config holds plain values afterwards
    config = SamplingConfig(
        max_new_tokens=np.int64(4), temperature=np.float32(0.5), top_k=np.int32(3), top_p=np.float64(0.9),
        n=np.int64(2), seed=np.array([7, 8]), eos_token_id=np.array([1, 2]),
    )  # fmt: skip
    plain = SamplingConfig(max_new_tokens=4, temperature=0.5, top_k=3, top_p=0.9, n=2, seed=[7, 8], eos_token_id=[1, 2])
    assert config == plain
    assert type(config.max_new_tokens) is int and type(config.temperature) is float
    assert all(type(seed) is int for seed in config.seed)
    assert SamplingConfig(seed=np.uint64(2**64 - 1)).seed == 2**64 - 1
    assert SamplingConfig(seed=(np.int32(1), 2)).seed == [1, 2]
    with pytest.raises(ValueError, match="seed=array"):
        SamplingConfig(seed=np.array([1.5]))
    with pytest.raises(ValueError, match="seed=-1"):
        SamplingConfig(seed=-1)
    engine = RolloutConfig(prefill_max_tokens=np.int64(64), cache_capacity=np.int32(99), prefix_cache_mb=np.float32(1.5))
    assert engine == RolloutConfig(prefill_max_tokens=64, cache_capacity=99, prefix_cache_mb=1.5)
    assert type(engine.prefill_max_tokens) is int and type(engine.prefix_cache_mb) is float


def test_numpy_seeds_sample_what_the_same_python_seeds_sample(model):
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    as_python = rollout.generate(GOOD_PROMPTS, sampling(temperature=1.0, seed=[5, 6, 7]))
    seeds = np.arange(5, 5 + len(GOOD_PROMPTS), dtype=np.uint32)
    assert rollout.generate(GOOD_PROMPTS, sampling(temperature=1.0, seed=seeds)).tokens == as_python.tokens
    other = rollout.generate(GOOD_PROMPTS, sampling(temperature=1.0, seed=seeds + 100))
    assert other.tokens != as_python.tokens  # control: the seeds reach the sampler


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"route": "fastest"}, "route='fastest'"),
        ({"route": None}, "route=None"),
        ({"prefill_max_tokens": 0}, "prefill_max_tokens=0"),
        ({"cache_capacity": 0}, "cache_capacity=0"),
        ({"cache_capacity": 12.5}, "cache_capacity=12.5"),
        ({"trim_cache": "yes"}, "trim_cache='yes'"),
        ({"profile": 1}, "profile=1"),
    ],
)
def test_bad_rollout_config_is_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RolloutConfig(**kwargs)


def test_wrong_config_types_are_type_errors(model):
    with pytest.raises(TypeError, match="RolloutConfig"):
        Rollout(model, config={"route": "aligned"})
    # the config in the tokenizer's slot, second positional: named, not an error at the first string prompt
    with pytest.raises(TypeError, match=re.escape("pass it by keyword, Rollout(model, config=RolloutConfig(...))")):
        Rollout(model, RolloutConfig(route="aligned"))
    with pytest.raises(TypeError, match="tokenizer must be a Hugging Face tokenizer"):
        Rollout(model, "gpt2")
    with pytest.raises(TypeError, match="SamplingConfig"):
        Rollout(model).generate(GOOD_PROMPTS, {"max_new_tokens": 3})


# ---- cache capacity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["equal_width", "aligned"])
def test_cache_capacity_below_the_longest_prompt_is_rejected_before_any_work(model, route):
    rollout = Rollout(model, config=RolloutConfig(route=route, cache_capacity=9))
    prompts = random_prompts([4, 9, 3], seed=6)
    with pytest.raises(ValueError, match=r"cache_capacity=9 is too small: prompt 1 has 9 tokens.*at least 14"):
        rollout.generate(prompts, sampling())
    fitting = [prompts[0], prompts[2]]  # 4 + BUDGET - 1 = 9 columns
    tokens, reasons = oracle_batch(model, fitting, BUDGET)
    assert_matches_oracle(rollout.generate(fitting, sampling()), tokens, reasons)


@pytest.mark.parametrize("route", ["equal_width", "aligned"])
def test_the_minimal_cache_capacity_is_exact_and_one_less_is_rejected(model, route):
    # Prompt 1 holds 9 prompt tokens plus BUDGET - 1 decoded ones: 14 columns; trims make it fit.
    prompts = random_prompts([4, 9, 3], seed=6)
    with pytest.raises(ValueError, match="cache_capacity=13 is too small"):
        Rollout(model, config=RolloutConfig(route=route, cache_capacity=13)).generate(prompts, sampling())
    result = Rollout(model, config=RolloutConfig(route=route, cache_capacity=14)).generate(prompts, sampling())
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    assert_matches_oracle(result, tokens, reasons)


# ---- model errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_a_model_error_during_decode_reaches_the_caller_unchanged(model, monkeypatch, route):
    rollout = Rollout(model, config=RolloutConfig(route=route))
    boom = RuntimeError("boom")
    forward = model.forward

    @functools.wraps(forward)
    def failing_decode(*args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None and input_ids.shape[1] == 1:
            raise boom
        return forward(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setitem(model.__dict__, "forward", failing_decode)
        with pytest.raises(RuntimeError) as info:
            rollout.generate(GOOD_PROMPTS, sampling())
    assert info.value is boom
    assert "forward" not in model.__dict__
    assert_still_exact(rollout)
