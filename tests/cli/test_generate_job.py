"""`autobucket generate`'s library side on a tiny random-weight model: input parsing with line-numbered
errors, prompt_ids vs text (a tiny model has no tokenizer), chunked runs against the oracle, and
all-or-nothing output."""

from __future__ import annotations

import io
import json

import pytest
from oracles import hf_greedy, oracle_batch
from workloads import random_prompts

from autobucket import Rollout
from autobucket.cli import main
from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.tools.generate_job import (
    GenerateJob,
    encode_prompts,
    generate_in_chunks,
    run_generate_job,
)
from autobucket.tools.generate_output import prompt_samples
from autobucket.tools.prompt_file import PromptRecord, parse_prompt_lines, read_prompts

MODEL = "tiny-qwen2"


def write_jsonl(path, items) -> None:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))


def test_txt_lines_are_prompts_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("first prompt\n\n  second, with spaces  \n{\"not\": \"json here\"}\n")
    records = read_prompts(path)
    assert [(r.id, r.line, r.text, r.ids) for r in records] == [
        (0, 1, "first prompt", None),
        (1, 3, "  second, with spaces  ", None),
        (2, 4, '{"not": "json here"}', None),
    ]


def test_jsonl_takes_prompt_or_prompt_ids_and_an_optional_id(tmp_path):
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt": "hi"}, "", {"id": "x", "prompt_ids": [5, 6]}, {"prompt": "yo", "max_new_tokens": 2}])
    records = read_prompts(path)
    assert records == [
        PromptRecord(id=0, line=1, text="hi", source=str(path)),
        PromptRecord(id="x", line=3, ids=[5, 6], source=str(path)),
        PromptRecord(id=2, line=4, text="yo", max_new_tokens=2, source=str(path)),
    ]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "unterminated}', "not valid JSON"),
        ('["prompt"]', "expected a JSON object"),
        ('{"id": 3}', 'exactly one of "prompt"'),
        ('{"prompt": "a", "prompt_ids": [1]}', 'exactly one of "prompt"'),
        ('{"prompt": ""}', '"prompt" must be a non-empty string'),
        ('{"prompt": 7}', '"prompt" must be a non-empty string'),
        ('{"prompt_ids": []}', '"prompt_ids" must be a non-empty list'),
        ('{"prompt_ids": [1, -2]}', '"prompt_ids" must be a non-empty list'),
        ('{"prompt_ids": [1, true]}', '"prompt_ids" must be a non-empty list'),
        ('{"prompt_ids": "1 2"}', '"prompt_ids" must be a non-empty list'),
        ('{"prompt_ids": [1], "max_new_tokens": 0}', '"max_new_tokens" must be an int >= 1'),
        ('{"prompt": "a", "max_new_tokens": "8"}', '"max_new_tokens" must be an int >= 1'),
        ('{"prompt": "a", "max_new_tokens": true}', '"max_new_tokens" must be an int >= 1'),
    ],
)
def test_a_bad_jsonl_line_names_its_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt": "ok"}, "", bad_line, {"prompt": "ok"}])
    with pytest.raises(ValueError, match=message) as error:
        read_prompts(path)
    assert str(error.value).startswith(f"{path}:3: ")


def test_format_follows_the_suffix_else_the_first_line(tmp_path):
    lines = ['{"prompt": "a"}']
    assert parse_prompt_lines(lines, "txt")[0].text == lines[0]
    assert parse_prompt_lines(lines, "jsonl")[0].text == "a"
    sniffed = tmp_path / "prompts.input"
    sniffed.write_text(lines[0] + "\n")
    assert read_prompts(sniffed)[0].text == "a"
    as_text = tmp_path / "prompts.txt"
    as_text.write_text(lines[0] + "\n")
    assert read_prompts(as_text)[0].text == lines[0]


def test_empty_or_missing_input_is_an_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no prompts"):
        read_prompts(empty)
    with pytest.raises(ValueError, match="cannot read prompts"):
        read_prompts(tmp_path / "missing.txt")


def test_text_prompts_need_a_tokenizer_and_ids_must_fit_the_vocabulary():
    text = [PromptRecord(id=0, line=1, ids=[1]), PromptRecord(id=1, line=4, text="hello")]
    with pytest.raises(ValueError, match=r"^<prompts>:4: a text prompt, but 'tiny-qwen2' has no tokenizer"):
        encode_prompts(text, None, chat=False, vocab_size=1024, model_name=repr(MODEL))
    with pytest.raises(ValueError, match=r"^in.jsonl:2: token id 1024 is outside the vocabulary \[0, 1024\)"):
        encode_prompts([PromptRecord(id=0, line=2, ids=[3, 1024], source="in.jsonl")], None, chat=False, vocab_size=1024)
    with pytest.raises(ValueError, match="^<prompts>:5: --chat applies to text prompts"):
        encode_prompts([PromptRecord(id=0, line=5, ids=[3])], None, chat=True, vocab_size=1024)


def test_chunked_job_matches_the_oracle_in_input_order(tiny_models, tmp_path):
    prompts = random_prompts([9, 2, 17, 5, 12], seed=3)
    path, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, [{"id": f"p{i}", "prompt_ids": p} for i, p in enumerate(prompts)])
    progress = []
    job = GenerateJob(
        prompts=str(path), out=str(out), model=MODEL, rollout=RolloutConfig(route="aligned"),
        sampling=SamplingConfig(max_new_tokens=6, continuous_batch_size=2), chunk_prompts=2,
    )  # fmt: skip
    summary = run_generate_job(job, lambda done, total: progress.append((done, total)))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected_tokens, expected_reasons = oracle_batch(tiny_models(MODEL), prompts, 6)
    assert [row["id"] for row in rows] == [f"p{i}" for i in range(5)]
    assert [row["tokens"] for row in rows] == expected_tokens
    assert [row["finish_reason"] for row in rows] == expected_reasons
    assert all(row["prompt"] is None and row["completion"] is None for row in rows)  # no tokenizer
    assert progress == [(0, 5), (2, 5), (4, 5), (5, 5)]
    assert summary["prompts"] == 5 and summary["routes_run"] == {"aligned": 3}
    assert summary["output_tokens"] == sum(len(t) for t in expected_tokens)
    assert summary["prompt_tokens"] == sum(len(p) for p in prompts)


def test_a_lines_own_budget_replaces_the_jobs_for_that_prompt(tiny_models, tmp_path):
    """"max_new_tokens" on a JSONL line is that prompt's budget; the others keep --max-new-tokens."""
    prompts = random_prompts([9, 2, 17, 5, 12], seed=3)
    own = {1: 3, 3: 11}
    path, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, [{"prompt_ids": p, **({"max_new_tokens": own[i]} if i in own else {})} for i, p in enumerate(prompts)])
    sampling = SamplingConfig(max_new_tokens=6, continuous_batch_size=2, eos_token_id=[])
    job = GenerateJob(prompts=str(path), out=str(out), model=MODEL, rollout=RolloutConfig(route="aligned"),
                      sampling=sampling, chunk_prompts=2)  # fmt: skip
    run_generate_job(job)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    budgets = [own.get(i, 6) for i in range(5)]
    expected = [oracle_batch(tiny_models(MODEL), [p], b, eos_token_id=[])[0][0] for p, b in zip(prompts, budgets, strict=True)]
    assert [row["tokens"] for row in rows] == expected
    assert [len(row["tokens"]) for row in rows] == [6, 3, 6, 11, 6]


SAMPLED = {"max_new_tokens": 5, "continuous_batch_size": 2, "temperature": 1.0, "top_p": 0.9, "n": 2, "seed": 11,
           "logprobs": True}  # fmt: skip


def one_call_samples(model, prompts, **sampling):
    """The oracle: every prompt's samples from one `generate` call over all of them."""
    result = Rollout(model, config=RolloutConfig(route="aligned")).generate(prompts, SamplingConfig(**sampling))
    return prompt_samples([result], sampling.get("n", 1))


def test_a_sampled_job_draws_what_one_call_draws_whatever_its_chunks(tiny_models, tmp_path):
    model = tiny_models(MODEL)
    prompts = random_prompts([9, 2, 17, 5, 12], seed=4)
    path, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, [{"id": f"p{i}", "prompt_ids": p} for i, p in enumerate(prompts)])
    job = GenerateJob(prompts=str(path), out=str(out), model=MODEL, rollout=RolloutConfig(route="bucketed"),
                      sampling=SamplingConfig(**SAMPLED), chunk_prompts=2)  # fmt: skip
    summary = run_generate_job(job)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = one_call_samples(model, prompts, **SAMPLED)
    assert [(row["id"], row["sample"]) for row in rows] == [(f"p{i}", s) for i in range(5) for s in range(2)]
    assert [row["tokens"] for row in rows] == [sample.tokens for samples in expected for sample in samples]
    assert [row["logprobs"] for row in rows] == [sample.logprobs for samples in expected for sample in samples]
    assert [row["finish_reason"] for row in rows] == [s.finish_reason for samples in expected for s in samples]
    assert rows[0]["tokens"] != rows[1]["tokens"]  # two samples of one prompt, not one repeated
    assert summary["finish_reasons"] == {"length": 10}


def test_one_sample_a_prompt_keeps_one_row_a_prompt_with_its_logprobs(tiny_models, tmp_path):
    prompts = random_prompts([9, 2, 17], seed=5)
    path, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, [{"prompt_ids": p} for p in prompts])
    sampling = {**SAMPLED, "n": 1}
    job = GenerateJob(prompts=str(path), out=str(out), model=MODEL, rollout=RolloutConfig(route="aligned"),
                      sampling=SamplingConfig(**sampling), chunk_prompts=2)  # fmt: skip
    run_generate_job(job)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = one_call_samples(tiny_models(MODEL), prompts, **sampling)
    assert [sorted(row) for row in rows] == [sorted(["id", "prompt", "completion", "tokens", "finish_reason",
                                                     "logprobs"])] * 3  # fmt: skip
    assert [(row["tokens"], row["logprobs"]) for row in rows] == [(s.tokens, s.logprobs) for [s] in expected]


def test_control_chunks_keyed_by_their_own_prompt_index_draw_something_else(tiny_models):
    """Why each chunk passes its prompts' whole-file stream keys: with the call-wide seed alone, a chunk's
    prompts are keyed by their index in the chunk, and every prompt after the first chunk draws anew."""
    model = tiny_models(MODEL)
    prompts = random_prompts([9, 2, 17, 5, 12], seed=4)
    rollout = Rollout(model, config=RolloutConfig(route="bucketed"))
    sampling = SamplingConfig(**SAMPLED)
    expected = [s.tokens for samples in one_call_samples(model, prompts, **SAMPLED) for s in samples]
    keyed = prompt_samples(generate_in_chunks(rollout, prompts, sampling, chunk=2), 2)
    assert [s.tokens for samples in keyed for s in samples] == expected
    unkeyed = [rollout.generate(prompts[start : start + 2], sampling) for start in range(0, 5, 2)]
    unkeyed_tokens = [s.tokens for samples in prompt_samples(unkeyed, 2) for s in samples]
    assert unkeyed_tokens[:4] == expected[:4]  # the first chunk's indices are the file's
    assert unkeyed_tokens[4:] != expected[4:]


def test_cli_sampling_flags_reach_the_rows(tiny_models, tmp_path, capsys, single_thread):
    prompts = random_prompts([4, 11], seed=8)
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt_ids": p} for p in prompts])
    argv = ["generate", "--model", MODEL, "--prompts", str(path), "--max-new-tokens", "5", "--route", "aligned",
            "--continuous-batch-size", "2", "--threads", "1", "--temperature", "1", "--top-p", "0.9", "--n", "2",
            "--seed", "11", "--logprobs", "--quiet"]  # fmt: skip (the oracle's batches and threads: bitwise logprobs)
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = one_call_samples(tiny_models(MODEL), prompts, **SAMPLED)
    assert [(row["id"], row["sample"]) for row in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(row["tokens"], row["logprobs"]) for row in rows] == [
        (sample.tokens, sample.logprobs) for samples in expected for sample in samples
    ]
    assert main([*argv[:-1], "--seed", "12", "--quiet"]) == 0  # another seed, other tokens
    assert [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()] != [r["tokens"] for r in rows]


def test_cli_processor_flags_give_single_request_generates_tokens(tiny_models, tmp_path, capsys):
    """--no-repeat-ngram-size, --suppress-tokens, --bad-words-ids and --generation-option sequence_bias (HF's
    processors, per prompt) against the model's own greedy `generate` with the same options, one prompt at a
    time; the options' values come from the unconstrained answers, so each bites (control: they change them).
    --generation-option eos_token_id=[] goes to the sampling config (a SamplingConfig field)."""
    model = tiny_models(MODEL)
    prompts = random_prompts([4, 11, 7], seed=8)
    free = hf_greedy(model, prompts, 6)
    options = {"no_repeat_ngram_size": 2, "suppress_tokens": [free[0][0]], "bad_words_ids": [[free[1][0], free[1][1]]],
               "sequence_bias": [[[free[2][2]], -4.0]]}  # fmt: skip
    expected = hf_greedy(model, prompts, 6, **options)
    assert expected != free
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt_ids": p} for p in prompts])
    flags = ["--no-repeat-ngram-size", "2", "--suppress-tokens", str(free[0][0]),
             "--bad-words-ids", f"{free[1][0]},{free[1][1]}",
             "--generation-option", f"sequence_bias=[[[{free[2][2]}], -4.0]]", "--generation-option", "eos_token_id=[]"]  # fmt: skip
    argv = ["generate", "--model", MODEL, "--prompts", str(path), "--max-new-tokens", "6", "--quiet", *flags]
    assert main(argv) == 0
    assert [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()] == expected


def test_cli_prefix_cache_serves_a_shared_header_across_the_runs_calls(tiny_models, tmp_path, capsys):
    """Twelve prompts behind one 40-token header, run as two calls of 8 (4 continuous batches of 2): with
    --prefix-cache-mb the second call's prompts take the header's K/V from the first's (the summary counts
    them) and the completions equal the model's own greedy generate; without it nothing is cached."""
    model = tiny_models(MODEL)
    header = random_prompts([40], seed=30)[0]
    prompts = [header + tail for tail in random_prompts([3, 5, 2, 7, 4, 6, 3, 5, 8, 2, 4, 3], seed=31)]
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt_ids": p} for p in prompts])
    base = ["generate", "--model", MODEL, "--prompts", str(path), "--max-new-tokens", "4", "--continuous-batch-size",
            "2", "--route", "aligned", "--generation-option", "eos_token_id=[]"]  # fmt: skip
    expected = hf_greedy(model, prompts, 4)
    for cache_mb, cached in (("8", True), ("0", False)):
        assert main([*base, "--prefix-cache-mb", cache_mb]) == 0
        captured = capsys.readouterr()
        assert [json.loads(line)["tokens"] for line in captured.out.splitlines()] == expected
        assert ("prompt tokens from the prefix cache" in captured.err) == cached, captured.err


@pytest.mark.parametrize(("flags", "message"), [
    (["--suppress-tokens", "a,3"], "argument --suppress-tokens: expected comma-separated token ids >= 0"),
    (["--bad-words-ids", "4,-1"], "argument --bad-words-ids: expected comma-separated token ids >= 0"),
    (["--suppress-tokens", "5,99999"], "--suppress-tokens holds 99999, which is not a token id of this model"),
    (["--generation-option", "=3"], "argument --generation-option: expected KEY=VALUE"),
    (["--generation-option", "foo=1"], "unknown generate option(s) ['foo']"),
    (["--generation-option", "temperature=0.5"], "--generation-option sets --temperature, a flag of its own"),
    (["--no-repeat-ngram-size", "2", "--generation-option", "no_repeat_ngram_size=3"],
     "--generation-option sets --no-repeat-ngram-size, a flag of its own: pass --no-repeat-ngram-size instead"),
    (["--generation-option", "min_p=0.1", "--generation-option", "min_p=0.2"], "sets 'min_p' twice"),
    (["--temperature", "1", "--generation-option", "min_p=7"], "min_p=7 is invalid: it must be in [0, 1]"),
    (["--prefix-cache-mb", "-1"], "argument --prefix-cache-mb: expected a finite number >= 0"),
    (["--compile", "yes"], "argument --compile: invalid choice: 'yes'"),
    (["--prefill-max-tokens", "0"], "argument --prefill-max-tokens: expected a positive integer"),
])  # fmt: skip
def test_bad_processor_flags_are_named(tmp_path, capsys, flags, message):
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt_ids": [3, 4]}])
    assert main(["generate", "--model", MODEL, "--prompts", str(path), "--max-new-tokens", "2", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--seed", "-1", "argument --seed: expected an integer in [0, 2**64), got '-1'"),
    ("--top-p", "2", "--top-p 2.0 is invalid: it must be in (0, 1]"),
    ("--temperature", "-1", "--temperature -1.0 is invalid"),
    ("--n", "0", "argument --n: expected a positive integer, got '0'"),
    # sampling flags under greedy decoding would be silently ignored
    ("--top-k", "5", "--top-k 5 only applies when sampling, and --temperature is 0"),
    ("--top-p", "0.9", "--top-p 0.9 only applies when sampling"),
    ("--n", "4", "--n 4 only applies when sampling"),
    ("--stop", "", "--stop [''] is invalid: give each --stop some text"),
])  # fmt: skip
def test_bad_sampling_flags_are_named(tmp_path, capsys, flag, value, message):
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt_ids": [3, 4]}])
    assert main(["generate", "--model", MODEL, "--prompts", str(path), flag, value]) == 2
    assert message in capsys.readouterr().err


def test_cli_reads_stdin_and_writes_stdout(tiny_models, monkeypatch, capsys):
    prompts = random_prompts([4, 11], seed=8)
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts)))
    argv = ["generate", "--model", MODEL, "--prompts", "-", "--max-new-tokens", "5", "--route", "equal_width"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert [row["tokens"] for row in rows] == oracle_batch(tiny_models(MODEL), prompts, 5)[0]
    assert "2 prompts" in captured.err and "route equal_width" in captured.err  # the summary


def test_a_failed_job_leaves_an_existing_output_untouched(tmp_path, capsys):
    path, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    path.write_text("text needs a tokenizer\n")
    out.write_text("previous results\n")
    assert main(["generate", "--model", MODEL, "--prompts", str(path), "--out", str(out)]) == 2
    assert f"{path}:1: a text prompt, but 'tiny-qwen2' has no tokenizer" in capsys.readouterr().err
    assert out.read_text() == "previous results\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "prompts.txt"]


def test_the_prompts_file_is_never_the_output(tmp_path, capsys, monkeypatch):
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt_ids": [3, 4]}])
    before = path.read_text()
    monkeypatch.chdir(tmp_path)  # the same file by another spelling
    assert main(["generate", "--model", MODEL, "--prompts", str(path), "--out", "prompts.jsonl"]) == 2
    assert "--out 'prompts.jsonl' is the --prompts file" in capsys.readouterr().err
    assert path.read_text() == before


def test_output_folder_must_exist_before_the_model_loads(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt_ids": [3, 4]}])
    argv = ["generate", "--model", MODEL, "--prompts", str(path), "--out", str(tmp_path / "nope" / "out.jsonl")]
    assert main(argv) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(("field", "value"), [("chunk_prompts", 0), ("chunk_prompts", True), ("chat", "yes"),
                                              ("input_format", "csv"), ("generation_options", "x")])  # fmt: skip
def test_bad_job_fields_are_named(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r} is invalid"):
        GenerateJob(prompts="-", **{field: value})
