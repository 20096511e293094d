"""The prompts file of `autobucket generate`: lines end at "\\n" or "\\r\\n" only, and every message about a
line names it as FILE:LINE: and in the file's own words (a JSONL key is the key, not the flag).

Oracles: `json.dumps` / `json.loads` for what a line holds, the model's own context length and greedy
`generate` for the rows; controls: `str.splitlines` cuts the same files, and the library's own messages
name chunk indices and flags where the file's lines and keys are meant."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from oracles import oracle_batch
from workloads import random_prompts

from autobucket.cli import main
from autobucket.cli.args import in_cli_words
from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.tools.generate_job import GenerateJob, run_generate_job
from autobucket.tools.generate_output import write_jsonl
from autobucket.tools.prompt_file import read_prompts, split_lines

MODEL = "tiny-qwen2"
# What `str.splitlines` ends a line at besides "\n" and "\r": JSON writes the last three unescaped.
OTHER_LINE_ENDS = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def test_a_jsonl_string_may_hold_the_characters_splitlines_ends_lines_at(tmp_path):
    prompts = [f"one{OTHER_LINE_ENDS}prompt", "second\u2028line", "third\u2029\x85end"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")
    assert len(path.read_text(encoding="utf-8").splitlines()) > len(prompts)  # control: they are in the file raw
    records = read_prompts(path)
    assert [r.text for r in records] == prompts and [r.line for r in records] == [1, 2, 3]


def test_a_text_prompt_keeps_form_feeds_and_the_other_line_ends(tmp_path):
    lines = ["page one\x0cpage two", f"a{OTHER_LINE_ENDS}b", "lone\rreturn stays"]
    path = tmp_path / "prompts.txt"
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
    assert len(path.read_text(encoding="utf-8").splitlines()) > len(lines)  # control
    assert [r.text for r in read_prompts(path)] == lines


def test_crlf_ends_a_line_like_lf(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"first\r\nsecond\r\n\r\nlast")
    assert [(r.line, r.text) for r in read_prompts(path)] == [(1, "first"), (2, "second"), (4, "last")]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_bytes(b'{"prompt": "a"}\r\n{"prompt": "b\\u2028c"}\r\n')
    assert [r.text for r in read_prompts(jsonl)] == ["a", "b\u2028c"]


@pytest.mark.parametrize("stream", ["bytes", "text"])
def test_stdin_splits_like_a_file(monkeypatch, stream):
    data = json.dumps({"prompt": "x\u2028y"}, ensure_ascii=False) + "\r\n" + "plain\rtext\n"
    fake = io.TextIOWrapper(io.BytesIO(data.encode()), encoding="utf-8") if stream == "bytes" else io.StringIO(data)
    monkeypatch.setattr("sys.stdin", fake)
    records = read_prompts("-", "txt")
    assert [r.text for r in records] == [json.dumps({"prompt": "x\u2028y"}, ensure_ascii=False), "plain\rtext"]
    assert records[0].where == "<stdin>:1"


def test_what_generate_writes_splits_back_into_its_rows(tmp_path):
    rows = [{"id": 0, "prompt": "a\u2028b", "completion": "c\u2029d\x85", "tokens": [1], "finish_reason": "length"},
            {"id": 1, "prompt": "e", "completion": "f", "tokens": [2], "finish_reason": "stop"}]  # fmt: skip
    out = tmp_path / "out.jsonl"
    write_jsonl(rows, str(out))
    text = out.read_text(encoding="utf-8")
    assert len(text.splitlines()) > len(rows)  # control
    assert [json.loads(line) for line in split_lines(text)] == rows


def test_generate_runs_a_line_whose_id_holds_a_line_separator(tiny_models, tmp_path, capsys):
    prompts = random_prompts([5, 9], seed=41)
    ids = ["first\u2028id", "second\u2029id"]
    path, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt_ids": p}, ensure_ascii=False) + "\n"
                            for i, p in zip(ids, prompts, strict=True)), encoding="utf-8")  # fmt: skip
    argv = ["generate", "--model", MODEL, "--prompts", str(path), "--out", str(out), "--max-new-tokens", "4", "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in split_lines(out.read_text(encoding="utf-8"))]
    assert [row["id"] for row in rows] == ids
    assert [row["tokens"] for row in rows] == oracle_batch(tiny_models(MODEL), prompts, 4)[0]


# ------------------------------------------------------------------ keys
@pytest.mark.parametrize(("key", "fix"), [
    ("max_new_token", 'did you mean "max_new_tokens"?'),
    ("prompt_id", 'did you mean "prompt_ids"?'),
    ("mesages", 'did you mean "messages"?'),
])  # fmt: skip
def test_a_misspelt_key_is_refused_with_the_close_match(tmp_path, key, fix):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_ids": [3]}\n' + json.dumps({"prompt_ids": [3, 4], key: 3}) + "\n")
    with pytest.raises(ValueError) as error:
        read_prompts(path)
    assert str(error.value) == (
        f'{path}:2: unknown key "{key}": {fix} (a line takes one of "prompt", "prompt_ids", "messages" and '
        'optionally "id", "max_new_tokens"; keys unlike these are ignored)'
    )


def test_a_data_sets_own_fields_are_ignored(tmp_path):
    """A data set's fields (an answer for the reward, a label) ride along; the prompt read is the same as
    without them (control: a misspelt key among them is still refused)."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_ids": [3, 4], "answer": "42", "difficulty": 3}\n')
    bare = tmp_path / "bare.jsonl"
    bare.write_text('{"prompt_ids": [3, 4]}\n')
    assert [dataclasses.replace(record, source="") for record in read_prompts(path)] == [
        dataclasses.replace(record, source="") for record in read_prompts(bare)
    ]
    path.write_text('{"prompt_ids": [3, 4], "answer": "42", "max_new_token": 3}\n')
    with pytest.raises(ValueError, match='unknown key "max_new_token": did you mean "max_new_tokens"'):
        read_prompts(path)


def test_the_cli_names_an_unknown_key_as_written(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_ids": [3, 4], "max_new_token": 3}\n')
    assert main(["generate", "--model", MODEL, "--prompts", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'autobucket generate: error: {path}:1: unknown key "max_new_token": did you mean '
                          '"max_new_tokens"?')  # fmt: skip
    assert "--max-new-tokens" not in err


# ------------------------------------------------------------------ budgets past the model's context
def context_error(tmp_path, capsys, lines: list[dict], *flags: str) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["generate", "--model", MODEL, "--prompts", str(path), "--quiet", *flags]) == 2
    return capsys.readouterr().err.strip().replace(str(path), "FILE")


def test_a_lines_budget_past_the_context_is_named_as_its_key_on_its_line(tiny_models, tmp_path, capsys):
    context = tiny_models(MODEL).config.max_position_embeddings
    lines = [{"prompt_ids": [3, 4]}, {"prompt_ids": [3, 4, 5], "max_new_tokens": context}]
    assert context_error(tmp_path, capsys, lines) == (
        f'autobucket generate: error: FILE:2: the prompt has 3 tokens; with its "max_new_tokens": {context} it '
        f'needs {context + 3} positions but the model has {context}: shorten it or lower this line\'s "max_new_tokens"'
    )
    lines[1]["max_new_tokens"] = context - 3  # the control: just fits
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["generate", "--model", MODEL, "--prompts", str(path), "--quiet", "--max-new-tokens", "1",
                 "--generation-option", "eos_token_id=[]"]) == 0  # fmt: skip
    assert [len(json.loads(row)["tokens"]) for row in capsys.readouterr().out.splitlines()] == [1, context - 3]


def test_the_jobs_budget_past_the_context_is_named_as_the_flag(tiny_models, tmp_path, capsys):
    context = tiny_models(MODEL).config.max_position_embeddings
    lines = [{"prompt_ids": [3, 4], "max_new_tokens": 2}, {"prompt_ids": [3, 4, 5]}]
    assert context_error(tmp_path, capsys, lines, "--max-new-tokens", str(context)) == (
        f"autobucket generate: error: FILE:2: the prompt has 3 tokens; with --max-new-tokens {context} it needs "
        f"{context + 3} positions but the model has {context}: shorten it or lower --max-new-tokens"
    )


def test_control_the_library_names_a_budget_as_the_setting_and_the_cli_keeps_json_keys():
    """Why the job checks the context itself: the engine's message says max_new_tokens=N, which the
    command's words turn into the flag, whichever budget it was; a quoted key is left as written."""
    words = {"max_new_tokens": "--max-new-tokens"}
    assert in_cli_words("with max_new_tokens=3000 it needs", words) == "with --max-new-tokens 3000 it needs"
    assert in_cli_words("lower max_new_tokens", words) == "lower --max-new-tokens"
    assert in_cli_words('its "max_new_tokens": 3000', words) == 'its "max_new_tokens": 3000'


# ------------------------------------------------------------------ an engine error inside a chunk
def test_an_engine_error_in_a_later_chunk_names_the_file_line_not_the_chunk_index(tmp_path):
    """The engine names a prompt by its index in the call; a job runs the file in chunks, so that index
    is not the file's: the message names FILE:LINE instead, and nothing is written (the run failed)."""
    path, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    lengths = [3, 4, 3, 20]  # the second chunk's second prompt (line 5, after a blank line) is too long
    lines = [json.dumps({"prompt_ids": p}) for p in random_prompts(lengths, seed=42)]
    path.write_text("\n".join([*lines[:2], "", *lines[2:]]) + "\n")
    job = GenerateJob(prompts=str(path), out=str(out), model=MODEL, chunk_prompts=2,
                      rollout=RolloutConfig(route="aligned", cache_capacity=12),
                      sampling=SamplingConfig(max_new_tokens=2))  # fmt: skip
    with pytest.raises(ValueError) as error:
        run_generate_job(job)
    message = str(error.value)
    assert message.startswith(f"{path}:5: cache_capacity=12 is too small: the prompt has 20 tokens"), message
    assert "prompt 1" not in message and not out.exists()
    assert isinstance(error.value.__cause__, ValueError) and "prompt 1 has 20 tokens" in str(error.value.__cause__)
