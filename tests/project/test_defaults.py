"""Defaults a user expects: `route="auto"` by default, one model loader whose keywords are
the CLI's `--model` flags, public types a checker can see (the `Literal`s and the `TYPE_CHECKING` names
behind the lazy `__init__`), and `--costs online` through the real console script."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
from oracles import assert_matches_oracle, oracle_batch
from workloads import random_prompts

import autobucket
from autobucket.config import COMPILE_CHOICES, ROUTES, CompileChoice, RolloutConfig, Route
from autobucket.models import CACHE_DIR_ENV

INIT = Path(autobucket.__file__)
MODEL_FLAGS = ("model", "dtype", "device", "attn_implementation", "trust_remote_code", "threads")


# ------------------------------------------------------------------ route="auto" by default
def test_the_default_route_is_auto_and_runs_what_auto_picks(tiny_models, monkeypatch, tmp_path):
    from autobucket import Rollout, SamplingConfig

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    assert RolloutConfig().route == "auto"
    model = tiny_models("tiny-qwen2")
    rollout = Rollout(model)
    assert rollout.config == RolloutConfig(route="auto")
    prompts = random_prompts([3, 17, 5], seed=3)
    result = rollout.generate(prompts, SamplingConfig(max_new_tokens=4))
    assert result.route in ("ordinary", "bucketed")  # what auto may run; "aligned" was the old default
    assert_matches_oracle(result, *oracle_batch(model, prompts, 4))


def test_the_generate_job_and_the_cli_agree_with_the_library_default():
    from autobucket.cli.main import build_parser
    from autobucket.tools.generate_job import GenerateJob

    args = build_parser().parse_args(["generate", "--prompts", "p.jsonl"])
    assert args.route == GenerateJob(prompts="-").rollout.route == RolloutConfig().route == "auto"
    assert args.kernels == GenerateJob(prompts="-").rollout.kernels == RolloutConfig().kernels == "auto"
    serve = build_parser().parse_args(["serve", "--model", "tiny-qwen2"])
    assert serve.kernels == "auto"


# ------------------------------------------------------------------ public types
def test_route_and_compile_literals_are_the_validated_choices():
    assert get_args(Route) == ROUTES and "auto" in ROUTES
    bool_type, auto = get_args(CompileChoice)
    assert bool_type is bool and get_args(auto) == ("auto",)
    assert set(COMPILE_CHOICES) == {True, False, "auto"}
    for route in ROUTES:
        assert RolloutConfig(route=route).route == route
    with pytest.raises(ValueError, match="route='auto-typo' is invalid"):
        RolloutConfig(route="auto-typo")  # type: ignore[arg-type]


def test_form_literal_holds_every_form_constant():
    from autobucket.planning.forms import CHUNKED, PACKED, PADDED, Form

    assert get_args(Form) == (PADDED, PACKED, CHUNKED)


def type_checking_imports(source: str) -> dict[str, str]:
    """name -> module of every `from M import name` under `if TYPE_CHECKING:` in `source`."""
    found: dict[str, str] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom) and statement.module
                found.update({alias.name: statement.module for alias in statement.names})
    return found


def test_type_checkers_see_every_lazy_name_from_where_it_resolves():
    source = INIT.read_text()
    assert type_checking_imports(source) == autobucket._LAZY_NAMES
    assert set(autobucket.__all__) == {"__version__", *autobucket._LAZY_NAMES}
    assert all(getattr(autobucket, name) is not None for name in autobucket._LAZY_NAMES)
    # Negative control: a lazy name left out of the TYPE_CHECKING block is noticed.
    dropped = source.replace("    from autobucket.profile import Profile\n", "")
    assert dropped != source and type_checking_imports(dropped) != autobucket._LAZY_NAMES


def readme_api_statements() -> list[str]:
    """The code (comments dropped) of every python block in the README's "Python API" section."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = [block.split("```", 1)[0] for block in section.split("```python\n")[1:]]
    lines = [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def test_the_typecheck_file_holds_every_readme_api_statement():
    checked = (Path(__file__).parents[1] / "typecheck" / "readme_api.py").read_text()
    statements = readme_api_statements()
    assert len(statements) >= 10 and any("RolloutConfig(" in line for line in statements)
    missing = [line for line in statements if line not in checked]
    assert not missing, f"README API lines that `make typecheck` does not check: {missing}"


# ------------------------------------------------------------------ one model loader, the CLI's names
def _model_group_dests() -> list[str]:
    from autobucket.cli.main import build_parser

    subparsers = next(a for a in build_parser()._actions if a.dest == "command")  # noqa: SLF001
    generate = subparsers.choices["generate"]
    wanted = {"--model", "--dtype", "--device", "--attn-implementation", "--trust-remote-code", "--threads"}
    return [a.dest for a in generate._actions if wanted & set(a.option_strings)]  # noqa: SLF001


def test_load_model_takes_the_cli_model_flags_by_name():
    from autobucket.cli.args import model_arguments
    from autobucket.cli.main import build_parser
    from autobucket.models import load_model

    parameters = list(inspect.signature(load_model).parameters)
    assert parameters == list(MODEL_FLAGS) == _model_group_dests()
    args = build_parser().parse_args(["generate", "--prompts", "p", "--model", "tiny-qwen2", "--threads", "1"])
    assert list(model_arguments(args)) == parameters
    assert autobucket.load_model is load_model
    import autobucket.models as models

    assert not hasattr(models, "load_any_model")  # one loader: the old duplicate is gone


def test_load_model_loads_every_model_form_with_those_keywords(tmp_path):
    import torch

    from autobucket.models import load_model

    model, tokenizer = load_model("tiny-llama", dtype="bfloat16", device="cpu", attn_implementation="eager")
    assert tokenizer is None and next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    config = tmp_path / "config.json"
    model.config.to_json_file(config)
    from_json, none = load_model(str(config), dtype=torch.float32)
    assert none is None and from_json.config.hidden_size == model.config.hidden_size
    assert next(from_json.parameters()).dtype == torch.float32


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dtype": "fp8"}, "dtype='fp8' is invalid: pass one of float32, bfloat16, float16"),
    ({"threads": 0}, "threads=0"),
    ({"model": "./absent"}, "model './absent' does not exist"),
    ({"device": "gpu"}, "device='gpu' is invalid: pass 'cpu', 'cuda' or 'cuda:N'"),
    ({"device": "cuda:99"}, "device='cuda:99' is invalid: this (torch .* sees no CUDA device|machine has)"),
])  # fmt: skip
def test_bad_loader_arguments_name_the_field(kwargs, message):
    from autobucket.models import load_model

    with pytest.raises(ValueError, match=message):
        load_model(**{"model": "tiny-qwen2", **kwargs})


def test_persist_costs_is_validated():
    with pytest.raises(ValueError, match="persist_costs='no'"):
        RolloutConfig(persist_costs="no")  # type: ignore[arg-type]
    assert RolloutConfig().persist_costs is True


# ------------------------------------------------------------------ --costs online through the console script
def console_script(*argv: str, cache: Path) -> subprocess.CompletedProcess:
    """The installed `autobucket` entry point (what a user types), with a cache folder of its own."""
    import os

    script = Path(sys.executable).with_name("autobucket")
    assert script.is_file(), f"no console script at {script}: pip install -e ."
    env = {**os.environ, CACHE_DIR_ENV: str(cache)}
    return subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=300, env=env)


def test_generate_costs_online_learns_and_stores_the_costs(tmp_path, tiny_models):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20, 21]]
    source, out, cache = tmp_path / "p.jsonl", tmp_path / "out.jsonl", tmp_path / "cache"
    source.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in prompts))
    completed = console_script("generate", "--model", "tiny-qwen2", "--prompts", str(source), "--costs", "online",
                               "--max-new-tokens", "3", "--threads", "1", "--out", str(out), cache=cache)  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert "(coefficients: probe - from a short probe on this machine)" in completed.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["tokens"] for row in rows] == oracle_batch(tiny_models("tiny-qwen2"), prompts, 3)[0]
    assert len(list((cache / "online-costs").glob("*.json"))) == 1  # what it learned was kept
    # Negative control: any other word is still a path, and a missing one is named.
    missing = console_script("generate", "--model", "tiny-qwen2", "--prompts", str(source), "--costs", "onlinex",
                             "--quiet", cache=cache)  # fmt: skip
    assert missing.returncode == 2 and "cannot read calibration file 'onlinex'" in missing.stderr
