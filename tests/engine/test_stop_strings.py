"""Stop strings (`SamplingConfig(stop_strings=...)`) against HF `generate(stop_strings=..., tokenizer=...)`.

The oracle is single-request HF `generate` with the same strings and tokenizer (transformers' own
`StopStringCriteria`). The tokenizer is a real byte-level BPE (`byte_tokenizer.byte_bpe_tokenizer`), so every id
the models generate is a token with text. Each test picks
its stop strings from what the model generates without them, so they do fire (asserted: a test whose
strings never fire could not fail), one of them straddling the prompt's end and the first generated token
(a matcher that reads only generated ids misses it: asserted too)."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from byte_tokenizer import BPE_CORPUS_CHARACTERS, byte_bpe_tokenizer, corpus_piece
from oracles import stop_string_oracle
from workloads import ARCHS, VOCAB, random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.batching.prefix_cache import BLOCK_TOKENS
from autobucket.engine.finished import cut_finished

pytestmark = pytest.mark.engine

MAX_NEW = 24
ROUTE_CASES = ("ordinary", "equal_width", "aligned", "auto")


@pytest.fixture(scope="module")
def tokenizer():
    return byte_bpe_tokenizer()


def free_generation(model, prompts) -> list[list[int]]:
    """Greedy tokens without EOS or stop strings (what the stop strings are picked from)."""
    result = Rollout(model, config=RolloutConfig(route="aligned")).generate(
        prompts, SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=[])
    )
    return result.tokens


def pick_stop_strings(tokenizer, prompts, generated) -> tuple[list[str], int, str]:
    """Three strings from the free generation: two from the middle of prompts 1 and 3's text, and one that
    straddles a prompt's last two characters and its first generated token's first (that prompt's index
    and the string returned too)."""
    texts = [tokenizer.decode(tokens) for tokens in generated]
    middle = [corpus_piece(texts[1], len(texts[1]) // 2, 4), corpus_piece(texts[3], len(texts[3]) // 3, 3)]
    for index, (prompt, tokens) in enumerate(zip(prompts, generated, strict=True)):
        straddling = tokenizer.decode(prompt)[-2:] + tokenizer.decode(tokens[:1])[:1]
        if set(straddling) <= BPE_CORPUS_CHARACTERS and index not in (1, 3):
            return [*middle, straddling], index, straddling
    raise AssertionError("no prompt's first token starts with a corpus character: change the workload")


def oracle(model, tokenizer, prompt, stop_strings) -> tuple[list[int], str]:
    """Single-request HF greedy generate with the stop strings, EOS off: new tokens and why it ended."""
    return stop_string_oracle(model, tokenizer, prompt, stop_strings, MAX_NEW, eos_off=True)


_CASES: dict[str, tuple] = {}


def stop_case(model_name, tiny_models, tokenizer):
    """(model, prompts, stop strings, (straddling prompt, string), oracle tokens, oracle reasons), once per model.

    Prompt ids are merged tokens (past the 3 specials and 256 bytes), so their text is the corpus'."""
    if model_name not in _CASES:
        model = tiny_models(model_name)
        rng = random.Random(11)
        prompts = [[rng.randrange(259, VOCAB) for _ in range(length)] for length in (5, 17, 2, 30, 9, 23)]
        strings, index, straddling = pick_stop_strings(tokenizer, prompts, free_generation(model, prompts))
        pairs = [oracle(model, tokenizer, prompt, strings) for prompt in prompts]
        case = (model, prompts, strings, (index, straddling), [t for t, _ in pairs], [r for _, r in pairs])
        _CASES[model_name] = case
    return _CASES[model_name]


@pytest.mark.parametrize("route", ROUTE_CASES)
@pytest.mark.parametrize("model_name", ARCHS)
def test_stop_strings_end_each_request_where_hf_generate_does(tiny_models, tokenizer, model_name, route):
    model, prompts, strings, straddling, expected, reasons = stop_case(model_name, tiny_models, tokenizer)
    assert reasons.count("stop") >= 2 and "length" in reasons, f"the strings must fire for some prompts: {reasons}"
    # the straddling string ends its prompt at once; read over generated text alone it is not there
    index, string = straddling
    assert reasons[index] == "stop" and string not in tokenizer.decode(expected[index]), (strings, expected[index])
    rollout = Rollout(model, tokenizer, RolloutConfig(route=route))
    result = rollout.generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=[], stop_strings=strings))
    assert result.tokens == expected
    assert result.finish_reasons == reasons


def test_a_stop_string_and_eos_each_end_requests(tiny_models, tokenizer):
    """EOS and stop strings together: whichever comes first ends the request, on every route alike."""
    model, prompts, strings, _, stop_tokens, stop_reasons = stop_case("tiny-qwen2", tiny_models, tokenizer)
    # an EOS that the longest-running unstopped request emits before its budget
    unstopped = [tokens for tokens, reason in zip(stop_tokens, stop_reasons, strict=True) if reason == "length"][0]
    eos = unstopped[MAX_NEW // 2]
    expected = [cut_finished(tokens, frozenset([eos]), MAX_NEW, len(tokens) if reason == "stop" else None)
                for tokens, reason in zip(stop_tokens, stop_reasons, strict=True)]  # fmt: skip
    assert "eos" in [reason for _, reason in expected] and "stop" in [reason for _, reason in expected]
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=eos, stop_strings=strings)
    for route in ROUTE_CASES:
        result = Rollout(model, tokenizer, RolloutConfig(route=route)).generate(prompts, sampling)
        assert (result.tokens, result.finish_reasons) == ([t for t, _ in expected], [r for _, r in expected]), route


def first_completion(tokenizer, strings, prompt, generated) -> int | None:
    """How many generated tokens it takes to complete a stop string: HF's criteria on each whole sequence."""
    from transformers import StopStringCriteria

    criteria = StopStringCriteria(tokenizer, strings)
    for length in range(1, len(generated) + 1):
        if criteria(torch.tensor([[*prompt, *generated[:length]]]), None)[0]:
            return length
    return None


@pytest.mark.parametrize(
    "config",
    [
        RolloutConfig(route="auto"),
        RolloutConfig(route="bucketed", prefill_max_tokens=16),  # chunked prefill
        RolloutConfig(route="auto", kernels="invariant", prefix_cache_mb=16),
        RolloutConfig(route="ordinary"),
    ],
    ids=["auto", "chunked", "invariant-prefix-cache", "ordinary"],
)
def test_sampled_requests_stop_at_their_first_completed_string(tiny_models, tokenizer, config):
    """n samples, refill (fewer rows than samples), sampled streams: each sample is its unstopped
    stream cut where HF's criteria first fire on the whole sequence."""
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([7, 19, 3, 26], seed=5)
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=[], temperature=1.0, n=3, seed=7,
                              continuous_batch_size=5, logprobs=True)  # fmt: skip
    free = Rollout(model, config=dataclasses.replace(config, prefix_cache_mb=0.0)).generate(prompts, sampling)
    flat = [(p, sample) for p, samples in enumerate(free.tokens) for sample in samples]
    strings = [corpus_piece(tokenizer.decode(flat[4][1]), 30, 3), corpus_piece(tokenizer.decode(flat[9][1]), 40, 2)]
    expected = []
    for p, sample in flat:
        length = first_completion(tokenizer, strings, prompts[p], sample)
        expected.append((sample[:length], "stop") if length is not None else (sample, "length"))
    assert sum(reason == "stop" for _, reason in expected) >= 2, "the strings must fire for some samples"
    rollout = Rollout(model, tokenizer, config)
    for _ in range(2):  # the second call reads the prefix cache where it is on
        result = rollout.generate(prompts, dataclasses.replace(sampling, stop_strings=strings))
        pairs = zip(result.tokens, result.finish_reasons, strict=True)
        got = [(t, r) for ts, rs in pairs for t, r in zip(ts, rs, strict=True)]
        assert got == expected
        free_logprobs = [lp for lps in free.logprobs for lp in lps]
        kept = [value for lps, (t, _) in zip(free_logprobs, expected, strict=True) for value in lps[: len(t)]]
        got_logprobs = [value for lps in result.logprobs for sample in lps for value in sample]
        if config.kernels == "invariant":  # the same bits whatever else is in the batch
            assert got_logprobs == kept
        else:  # the default kernels' GEMMs may round differently in another batch
            assert torch.allclose(torch.tensor(got_logprobs), torch.tensor(kept), atol=1e-4)


@pytest.mark.parametrize("route", ROUTE_CASES)
def test_the_models_own_stop_strings_apply_and_the_callers_replace_them(tiny_models, tokenizer, route):
    """None takes the model's generation_config strings, [] turns them off, a list replaces them, on every
    route (transformers 5.x refills a None field of the config `generate` is given from the model's own:
    the ordinary route once raised for want of a tokenizer, or matched the model's strings)."""
    model, prompts, strings, _, expected, reasons = stop_case("tiny-llama", tiny_models, tokenizer)
    model = copy.deepcopy(model)  # the shared model stays as built
    model.generation_config.stop_strings = strings
    rollout = Rollout(model, tokenizer, RolloutConfig(route=route))
    own = rollout.generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=[]))
    assert (own.tokens, own.finish_reasons) == (expected, reasons)
    off = rollout.generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=[], stop_strings=[]))
    assert off.finish_reasons == ["length"] * len(prompts)
    mine = rollout.generate(prompts, SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=[], stop_strings=strings[:1]))
    pairs = [oracle(model, tokenizer, prompt, strings[:1]) for prompt in prompts]
    assert (mine.tokens, mine.finish_reasons) == ([t for t, _ in pairs], [r for _, r in pairs]) != (expected, reasons)


def test_a_token_added_to_the_tokenizer_between_calls_completes_a_stop_string(tiny_models):
    """The stop-string matcher is kept between calls with the same strings; a trainer adding a token (and
    resizing the model) in between needs a new one, or a string completed by the new token is missed.
    Oracle: HF generate with the grown tokenizer; the new token is made greedy's choice somewhere."""
    tokenizer = byte_bpe_tokenizer()  # its own: tokens are added to it
    model = copy.deepcopy(tiny_models("tiny-llama"))
    rollout = Rollout(model, tokenizer, RolloutConfig(route="aligned"))
    prompts = [[300, 301, 302], [400, 401], [500, 510, 520, 530]]
    turn = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=[], stop_strings=["zq"])  # "z", "q": not in the corpus
    assert rollout.generate(prompts, turn).finish_reasons == ["length"] * len(prompts)
    tokenizer.add_tokens(["zq"])
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        model.get_output_embeddings().weight[VOCAB] = 3 * model.get_output_embeddings().weight[7]
    pairs = [stop_string_oracle(model, tokenizer, prompt, ["zq"], MAX_NEW, eos_off=True) for prompt in prompts]
    assert "stop" in [reason for _, reason in pairs], "the new token never completes the string: a weak case"
    result = rollout.generate(prompts, turn)
    assert (result.tokens, result.finish_reasons) == ([t for t, _ in pairs], [r for _, r in pairs])


def test_cut_finished_orders_eos_before_stop_before_length():
    assert cut_finished([5, 6, 7, 8], frozenset([6]), 10, stop_length=2) == ([5, 6], "eos")
    assert cut_finished([5, 6, 7, 8], frozenset([7]), 10, stop_length=2) == ([5, 6], "stop")
    assert cut_finished([5, 6, 7, 8], frozenset(), 3, stop_length=4) == ([5, 6, 7], "length")
    assert cut_finished([5, 6, 7, 8], frozenset(), 3, stop_length=3) == ([5, 6, 7], "stop")
    assert cut_finished([5, 6, 7, 8], frozenset(), 4) == ([5, 6, 7, 8], "length")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "stop_strings='' is invalid: pass a non-empty string"),
        ([""], r"stop_strings=\[''\] is invalid"),
        ([3], r"stop_strings=\[3\] is invalid"),
        (7, "stop_strings=7 is invalid"),
    ],
)
def test_bad_stop_strings_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(stop_strings=value)


def test_stop_strings_need_a_tokenizer_and_are_not_an_override(tiny_models, tokenizer):
    model = tiny_models("tiny-llama")
    prompts = random_prompts([4, 6], seed=1)
    without_tokenizer = Rollout(model, config=RolloutConfig(route="aligned"))
    with pytest.raises(ValueError, match=r"stop_strings=\['ab'\] need the model's tokenizer .*Rollout\(model, tokenizer"):
        without_tokenizer.generate(prompts, SamplingConfig(stop_strings=["ab"]))
    rollout = Rollout(model, tokenizer, RolloutConfig(route="aligned"))
    with pytest.raises(ValueError, match=r"pass sampling=SamplingConfig\(stop_strings=\['ab'\]\) instead"):
        rollout.generate(prompts, SamplingConfig(), stop_strings=["ab"])
    # both still generate afterwards, as before the refused calls
    assert without_tokenizer.generate(prompts).tokens == rollout.generate(prompts).tokens
    assert SamplingConfig(stop_strings=("a", "b")).stop_strings == ["a", "b"]


def test_cli_stop_flags_end_completions_as_the_api_does(tiny_models, tokenizer, tmp_path, capsys):
    import json

    from autobucket.cli import main
    from autobucket.models import build_tiny_model, load_model

    _, prompts, strings, _, _, reasons = stop_case("tiny-llama", tiny_models, tokenizer)
    folder = tmp_path / "model"
    build_tiny_model("tiny-llama").save_pretrained(folder)  # a fresh copy: saving changes a model's config
    tokenizer.save_pretrained(folder)
    capsys.readouterr()  # what saving logged (DeepSpeed's accelerator line, when installed) is not the command's
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    flags = [flag for string in strings for flag in ("--stop", string)]
    argv = ["generate", "--model", str(folder), "--prompts", str(path), "--max-new-tokens", str(MAX_NEW),
            "--route", "aligned", "--quiet"]  # fmt: skip
    assert main([*argv, *flags]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    model, loaded_tokenizer = load_model(str(folder))
    expected = Rollout(model, loaded_tokenizer, RolloutConfig(route="aligned")).generate(
        prompts, SamplingConfig(max_new_tokens=MAX_NEW, stop_strings=strings)
    )
    assert [(row["tokens"], row["finish_reason"]) for row in rows] == list(
        zip(expected.tokens, expected.finish_reasons, strict=True)
    )
    assert "stop" in expected.finish_reasons
    # a model without a tokenizer cannot match text: named before any generation
    assert main(["generate", "--model", "tiny-llama", "--prompts", str(path), "--stop", "ab", "--quiet"]) == 2
    assert "--stop ['ab'] needs a tokenizer to match text, and 'tiny-llama' has none" in capsys.readouterr().err


def test_only_rows_whose_last_token_can_end_a_string_are_matched_and_nothing_is_missed(tokenizer):
    """The matcher skips sequences whose last token holds no string's last character; over random tails and
    tails built to end each string (text tokenized whole, so tokens overhang it), it answers exactly what
    matching every sequence answers, and the skip is real (most ids cannot end these strings)."""
    from autobucket.engine.finished import StopStrings

    stops = StopStrings(tokenizer, ["ab", "</c", "p_o>"])
    assert stops.enders is not None and 0 < len(stops.enders) < VOCAB // 2
    rng = random.Random(2)
    sequences = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(3000)]
    for string in stops.strings:
        for prefix in ("", "k", "gh ", "/"):
            for suffix in ("", "d", "> e"):
                sequences.append(tokenizer(prefix + string + suffix)["input_ids"])
    unfiltered = copy.copy(stops)
    unfiltered.enders = None
    requests = [((), sequence) for sequence in sequences]  # no prompt: each sequence is all generated
    expected = unfiltered.completed(requests)
    assert sum(expected) >= 10, "the built tails must end strings, else the comparison is empty"
    assert stops.completed(requests) == expected


def test_a_tokenizer_stop_strings_cannot_use_is_named_and_the_rollout_goes_on(tiny_models):
    """A word-level tokenizer (its vocabulary has no byte or piece text HF can read) fails inside transformers
    with "substring not found": the error names the strings, the tokenizer and the fix instead."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<pad>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")
    rollout = Rollout(tiny_models("tiny-llama"), words, RolloutConfig(route="aligned"))
    prompts = random_prompts([4, 6], seed=1)
    message = r"stop_strings=\['w12'\] cannot be matched with this \w+ \(transformers' StopStringCriteria: .+\): use"
    with pytest.raises(ValueError, match=message):
        rollout.generate(prompts, SamplingConfig(stop_strings=["w12"]))
    plain = Rollout(tiny_models("tiny-llama"), config=RolloutConfig(route="aligned")).generate(prompts)
    assert rollout.generate(prompts).tokens == plain.tokens


@pytest.mark.parametrize("kernels", ["hf", "invariant"])
def test_tool_turns_that_end_at_a_stop_string_continue_from_the_prefix_cache(tiny_models, tokenizer, kernels):
    """The agent pattern: each turn ends at a stop string (a tool call's end), the caller appends its tool's
    reply, the next turn continues. Each turn equals single-request HF generate with the strings over the
    whole conversation, and the next turn prefills only what the cache lacks: every id of the previous
    conversation but the stopping token (never fed back), where that is at least a block."""
    model, first, strings, _, _, _ = stop_case("tiny-qwen3", tiny_models, tokenizer)
    # aligned: every hit is continued (auto may prefill a short cached prefix whole when that is cheaper)
    rollout = Rollout(model, tokenizer, RolloutConfig(route="aligned", kernels=kernels, prefix_cache_mb=16))
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_id=[], stop_strings=strings)
    rng, conversations, previous, stopped = random.Random(4), [list(p) for p in first], None, 0
    for turn in range(3):
        result = rollout.generate(conversations, sampling)
        expected = [oracle(model, tokenizer, conversation, strings) for conversation in conversations]
        assert list(zip(result.tokens, result.finish_reasons, strict=True)) == expected, f"turn {turn}"
        stopped += result.finish_reasons.count("stop")
        if previous is not None:  # a hit under one block (16 ids) is not used: prefilled whole
            had_kv = [len(c) + len(t) - 1 for c, t in previous]
            assert result.profile.cached_prompt_tokens == sum(n for n in had_kv if n >= BLOCK_TOKENS)
            assert result.profile.cached_prompt_tokens > 0
        tools = [[rng.randrange(259, VOCAB) for _ in range(rng.randint(1, 9))] for _ in conversations]
        previous = list(zip(conversations, result.tokens, strict=True))
        conversations = [c + t + x for c, t, x in zip(conversations, result.tokens, tools, strict=True)]
    assert stopped >= 3, "the strings must end some turns, else this is the plain multi-turn test"
