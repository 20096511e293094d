"""The command line's rough edges, each through the real parser or a real process: every option has help,
--version, --allow-mismatch wherever a calibration file is taken, Ctrl-C (a real SIGINT) writes what
finished and exits 130 without a traceback, --quiet silences transformers' loading bar, and counts read
as English ("1 prompt", "1 bucket", "--top-k 5 only applies")."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from oracles import oracle_batch
from test_cli_demo_layout import demo_report
from workloads import random_prompts

from autobucket.cli import main
from autobucket.cli.args import in_cli_words
from autobucket.cli.main import build_parser
from autobucket.costs.calibration_file import calibration_metadata, save_calibration
from autobucket.costs.coefficients import CostCoefficients

MODEL = "tiny-qwen2"
SOME_COSTS = CostCoefficients(fixed_ms=2.0, token_ms=0.5, attention_ms=0.0, kv_ms=0.01, decode_ms=1.0)


def run_cli(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autobucket.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def write_prompts(path: Path, prompts: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    return path


# ------------------------------------------------------------------ help and version
def actions_without_help(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("autobucket",)) -> list[str]:
    """Every option or positional of `parser` and its subcommands that --help would list bare."""
    missing = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of a parser's actions
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, subparser in action.choices.items():
                missing += actions_without_help(subparser, (*path, name))
        elif not action.help:
            missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_option_of_every_command_has_help():
    assert actions_without_help(build_parser()) == []
    bare = argparse.ArgumentParser(prog="x")  # the control: one option without help is found
    bare.add_argument("--seed", type=int)
    bare.add_argument("--quiet", action="store_true", help="say less")
    assert actions_without_help(bare, ("x",)) == ["x --seed"]


def test_version_prints_the_installed_packages_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"autobucket {version('autobucket')}\n"


# ------------------------------------------------------------------ --allow-mismatch
@pytest.fixture
def other_dtype_costs(tmp_path, tiny_models):
    """A calibration of the tiny model as if measured in bf16: refused unless --allow-mismatch."""
    metadata = {**calibration_metadata(tiny_models(MODEL), MODEL), "dtype": "bfloat16"}
    path = tmp_path / "costs.json"
    save_calibration(path, SOME_COSTS, metadata)
    return path


def test_generate_takes_allow_mismatch_as_its_error_suggests(tiny_models, tmp_path, other_dtype_costs):
    prompts = random_prompts([4, 9], seed=51)
    path = write_prompts(tmp_path / "prompts.jsonl", prompts)
    argv = ["generate", "--model", MODEL, "--prompts", str(path), "--costs", str(other_dtype_costs),
            "--max-new-tokens", "3", "--threads", "1", "--quiet"]  # fmt: skip
    refused = run_cli(*argv)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip() == (
        f"autobucket generate: error: calibration file '{other_dtype_costs}' was measured on a different setup "
        "(dtype: file 'bfloat16' vs now 'float32'): recalibrate with `autobucket calibrate`, or pass "
        "--allow-mismatch to use it anyway"
    )
    taken = run_cli(*argv, "--allow-mismatch")
    assert taken.returncode == 0, taken.stderr
    assert [json.loads(row)["tokens"] for row in taken.stdout.splitlines()] == oracle_batch(tiny_models(MODEL), prompts, 3)[0]
    assert any("warning" in line and "bfloat16" in line for line in taken.stderr.splitlines()), taken.stderr


def test_demo_takes_allow_mismatch_too(tiny_models, other_dtype_costs):
    from autobucket.tools.demo import demo_costs

    args = build_parser().parse_args(["demo", "--costs", str(other_dtype_costs), "--allow-mismatch"])
    assert args.allow_mismatch
    with pytest.raises(ValueError) as error:
        demo_costs(tiny_models(MODEL), other_dtype_costs)
    assert in_cli_words(str(error.value), args.cli_words).endswith("or pass --allow-mismatch to use it anyway")
    with pytest.warns(UserWarning, match="measured on a different setup"):
        costs, label = demo_costs(tiny_models(MODEL), other_dtype_costs, strict=False)
    assert costs.to_dict() == SOME_COSTS.to_dict() and label == f"from {other_dtype_costs}"


# ------------------------------------------------------------------ Ctrl-C
# Runs `autobucket generate` with a real SIGINT sent to the process while its N-th generate call runs.
INTERRUPT_AT_CALL = """
import os, signal, sys
from autobucket.cli import main
from autobucket.engine.rollout import Rollout

calls, generate = [], Rollout.generate
def generate_until_ctrl_c(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGINT)
    return generate(self, *args, **kwargs)
Rollout.generate = generate_until_ctrl_c
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(("call", "written"), [(2, 4), (1, 0)])
def test_ctrl_c_writes_the_finished_prompts_and_exits_130(tiny_models, tmp_path, call, written):
    """Six prompts in chunks of four (--continuous-batch-size 1: four continuous batches a chunk): Ctrl-C
    in the second chunk keeps the first chunk's four rows, which are the model's own greedy tokens; in
    the first, nothing had finished and the previous output stays."""
    prompts = random_prompts([5, 3, 8, 4, 6, 2], seed=52)
    path, out = write_prompts(tmp_path / "prompts.jsonl", prompts), tmp_path / "out.jsonl"
    out.write_text("previous results\n")
    argv = ["generate", "--model", MODEL, "--prompts", str(path), "--out", str(out), "--max-new-tokens", "3",
            "--continuous-batch-size", "1", "--threads", "1"]  # fmt: skip
    completed = subprocess.run([sys.executable, "-c", INTERRUPT_AT_CALL, str(call), *argv], capture_output=True,
                               text=True, timeout=600)  # fmt: skip
    assert completed.returncode == 128 + signal.SIGINT == 130
    assert "Traceback" not in completed.stderr
    if written:
        assert completed.stderr.strip().splitlines()[-1] == (
            f"autobucket generate: interrupted: wrote the rows of the first 4 of 6 prompts to '{out}'"
        )
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [row["id"] for row in rows] == [0, 1, 2, 3]
        assert [row["tokens"] for row in rows] == oracle_batch(tiny_models(MODEL), prompts[:4], 3)[0]
    else:
        assert completed.stderr.strip().splitlines()[-1] == (
            "autobucket generate: interrupted before any of the 6 prompts finished: nothing written"
        )
        assert out.read_text() == "previous results\n"


# ------------------------------------------------------------------ --quiet
@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A model folder as `save_pretrained` writes it: loading it draws transformers' loading bar."""
    from autobucket.models import build_tiny_model

    folder = tmp_path_factory.mktemp("saved-model")
    build_tiny_model(MODEL).save_pretrained(folder)
    return folder


def test_quiet_silences_transformers_loading_bar(saved_model, tmp_path):
    path = write_prompts(tmp_path / "prompts.jsonl", [[3, 4, 5]])
    completed = run_cli("generate", "--model", str(saved_model), "--prompts", str(path), "--max-new-tokens", "2",
                        "--threads", "1", "--quiet")  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert len(json.loads(completed.stdout)["tokens"]) == 2
    assert "Loading weights" not in completed.stderr and "it/s]" not in completed.stderr, completed.stderr
    loading = subprocess.run([sys.executable, "-c", f"from autobucket.models import load_model; load_model({str(saved_model)!r})"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert loading.returncode == 0 and "Loading weights" in loading.stderr  # the control: the bar is there


# ------------------------------------------------------------------ counts in words
def test_counts_of_one_are_singular():
    from autobucket.cli.demo import _agreement_line
    from autobucket.cli.generate import summary_lines
    from autobucket.tools.wording import counted

    assert [counted(n, "prompt") for n in (0, 1, 2)] == ["0 prompts", "1 prompt", "2 prompts"]
    summary = {"prompts": 1, "prompt_tokens": 1, "output_tokens": 1, "generate_s": 0.5, "tokens_per_s": 2.0,
               "load_s": 0.1, "route": "auto", "routes_run": {"aligned": 1}, "bucket_widths": [[1]],
               "prefill_forwards": 1, "prefill_tokens": 1, "cached_prompt_tokens": 1, "decode_forwards": 1,
               "finish_reasons": {"length": 1}, "out": "-", "costs_source": "online", "predicted_ms": None}  # fmt: skip
    lines = summary_lines(summary)
    assert lines[:3] == [
        "generate: 1 prompt (1 prompt token) -> 1 token in 0.50 s (2.0 tok/s); model load 0.1 s",
        "route auto ran aligned in 1 of 1 call; first-admission prefill widths 1",
        "1 prefill forward (1 padded token, 1 prompt token from the prefix cache), 1 decode forward; finish: "
        "length 1; out: -",
    ]
    many = summary_lines({**summary, "prompts": 2, "prompt_tokens": 7, "routes_run": {"aligned": 2}})
    assert many[0].startswith("generate: 2 prompts (7 prompt tokens)") and "in 2 of 2 calls" in many[1]
    assert "aligned (1 prompt)" in _agreement_line(demo_report())


def test_sampling_flags_under_greedy_agree_with_their_count(tmp_path, capsys):
    path = write_prompts(tmp_path / "prompts.jsonl", [[3, 4]])
    base = ["generate", "--model", MODEL, "--prompts", str(path)]
    assert main([*base, "--top-k", "5"]) == 2
    assert "error: --top-k 5 only applies when sampling, and --temperature is 0" in capsys.readouterr().err
    assert main([*base, "--top-k", "5", "--n", "4"]) == 2
    assert "error: --top-k 5 and --n 4 only apply when sampling, and --temperature is 0" in capsys.readouterr().err
