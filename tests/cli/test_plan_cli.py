"""`autobucket plan`: argument parsing, table and JSON output, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autobucket.cli import main
from autobucket.cli.args import parse_lengths
from autobucket.costs.coefficients import BENCH_QWEN2_GEOMETRY, CostCoefficients

QWEN25_3B_FLAGS = ["--layers", "36", "--query-heads", "16", "--kv-heads", "2", "--head-dim", "128"]


@pytest.fixture
def costs_file(tmp_path):
    path = tmp_path / "costs.json"
    costs = CostCoefficients(fixed_ms=25.0, token_ms=0.1, attention_ms=0.01, kv_ms=0.04, decode_ms=10.0)
    path.write_text(json.dumps({"schema_version": 1, "costs": costs.to_dict()}))
    return path


def run_json(capsys, *argv: str) -> dict:
    assert main(["plan", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_parse_lengths_expands_repeats():
    assert parse_lengths("512,16x31") == [512] + [16] * 31
    assert parse_lengths(" 3 , 2X2 ") == [3, 2, 2]


def test_json_plan_for_the_long_tail(capsys, costs_file):
    result = run_json(
        capsys, "--lengths", "512,16x31", "--costs", str(costs_file), "--packing", "none", *QWEN25_3B_FLAGS
    )
    assert result["route"] == "bucketed"
    assert result["buckets"] == [[0], list(range(1, 32))] and result["forms"] == ["padded", "padded"]
    assert result["widths"] == [512, 16]
    assert result["ordinary_ms"] > result["bucketed_ms"] > 0
    assert result["geometry"]["layers"] == 36 and result["geometry"]["max_positions"] == 32768
    assert result["costs"]["decode_ms"] == 10.0 and result["prefill_max_tokens"] == 65536


def test_json_uses_costs_from_the_file(capsys, tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"fixed_ms": 5000.0}))  # huge fixed cost: one bucket beats two
    result = run_json(capsys, "--lengths", "512,16x31", "--costs", str(path), "--continuous-batch-size", "16")
    assert result["route"] == "bucketed" and result["buckets"] == [list(range(32))]
    assert result["costs"]["fixed_ms"] == 5000.0


def test_default_geometry_and_dp_skip(capsys):
    result = run_json(capsys, "--lengths", "16x32")
    assert result["geometry"] == {
        "layers": 4,
        "query_heads": 4,
        "kv_heads": 2,
        "head_dim": 64,
        "element_bytes": 4,
        "max_positions": 32768,
    }
    assert BENCH_QWEN2_GEOMETRY.layers == 4
    assert result["route"] == "ordinary" and result["bucketed_ms"] is None and result["buckets"] == []


def test_prefill_limit_flags(capsys):
    limited = run_json(capsys, "--lengths", "512x129", "--continuous-batch-size", "256")
    assert "max_tokens 65536" in limited["reason"] and limited["route"] == "bucketed"
    assert limited["continuous_batch_size"] == 256 and limited["prefill_max_tokens"] == 65536
    unlimited = run_json(capsys, "--lengths", "512x129", "--continuous-batch-size", "256", "--no-prefill-limit")
    assert unlimited["prefill_max_tokens"] is None and unlimited["route"] == "ordinary"
    lowered = run_json(capsys, "--lengths", "512x4", "--prefill-max-tokens", "1024")
    assert lowered["prefill_max_tokens"] == 1024 and all(len(bucket) <= 2 for bucket in lowered["buckets"])


# Renamed flags (one word per concept) keep their old spelling as a hidden alias for one release.
RENAMED = [
    (["--capacity", "16"], ["--continuous-batch-size", "16"]),
    (["--max-tokens", "1024"], ["--prefill-max-tokens", "1024"]),
    (["--no-token-limit"], ["--no-prefill-limit"]),
]


@pytest.mark.parametrize(("old", "new"), RENAMED)
def test_old_flag_spellings_still_work_and_say_the_new_one(capsys, old, new):
    argv = ["--lengths", "512,16x31,512x3"]
    assert run_json(capsys, *argv, *old) == run_json(capsys, *argv, *new)
    assert main(["plan", "--json", *argv, *old]) == 0
    assert f"{old[0]} is deprecated and will be removed: use {new[0]}" in capsys.readouterr().err
    assert main(["plan", "--help"]) == 0
    assert old[0] not in capsys.readouterr().out  # hidden


def test_a_prompt_over_the_prefill_budget_is_planned_in_chunks_not_refused():
    """--prefill-max-tokens is a budget (it used to be this command's one library error)."""
    completed = run_cli("plan", "--lengths", "1000000", "--max-positions", "1048576")
    assert completed.returncode == 0 and completed.stderr == ""
    assert "chunked:16" in completed.stdout  # ceil(1,000,000 / 65,536) forwards


def test_model_config_file(capsys, tmp_path):
    config = {
        "model_type": "qwen3",
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "hidden_size": 1024,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = run_json(capsys, "--lengths", "100x4", "--model-config", str(path), "--kv-heads", "4")
    assert result["geometry"] == {
        "layers": 28,
        "query_heads": 16,
        "kv_heads": 4,
        "head_dim": 128,
        "element_bytes": 2,
        "max_positions": 40960,
    }


def test_table_output(capsys, costs_file):
    argv = ["plan", "--lengths", "512,16x31", "--costs", str(costs_file), "--packing", "none", *QWEN25_3B_FLAGS]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Prefill groups" in out and "1-31" in out and "padded" in out
    assert "bucketed estimated cheaper" in out
    assert "chosen route" in out and "bucketed" in out


def test_plan_shows_packed_groups_and_chunks(capsys, costs_file):
    argv = ["--lengths", "70000,512,16x31", "--costs", str(costs_file), "--max-tokens", "4096", "--max-positions", "131072"]
    result = run_json(capsys, *argv)
    assert result["route"] == "bucketed" and result["forms"][0] == "chunked" and "packed" in result["forms"]
    assert result["buckets"][0] == [0] and sorted(i for b in result["buckets"] for i in b) == list(range(33))
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    assert "chunked:18" in out and "packed" in out


@pytest.mark.parametrize("bad", ["16x", "x3", "abc", "0", "16x0", "-4", "5,,6", "2.5", ""])
def test_bad_lengths_exit_2_with_the_item_and_an_example(capsys, bad):
    assert main(["plan", "--lengths", bad]) == 2
    err = capsys.readouterr().err
    assert "bad --lengths item" in err and "512,16x31" in err


def test_a_prompt_past_the_models_positions_is_refused_as_the_engine_refuses_it(capsys):
    """The engine's context check (`prompts.check_context`) refuses prompt + budget > max_positions; a plan
    for such a call would plan one that cannot run."""
    argv = ["plan", "--lengths", "16x3,4000", "--max-positions", "4096"]
    assert main([*argv, "--max-new-tokens", "96"]) == 0  # 4000 + 96 = 4096 fits exactly
    capsys.readouterr()
    assert main([*argv, "--max-new-tokens", "97"]) == 2
    err = capsys.readouterr().err
    assert "prompt 3 has 4000 tokens" in err and "4097 positions" in err and "--max-positions 4096" in err
    assert main(["plan", "--lengths", "40000"]) == 2  # the default geometry's 32,768 positions
    assert "32768" in capsys.readouterr().err


def test_library_errors_exit_2(capsys, tmp_path):
    assert main(["plan", "--lengths", "5", "--packing", "flex"]) == 2
    assert "--packing" in capsys.readouterr().err
    missing = tmp_path / "nope.json"
    assert main(["plan", "--lengths", "5", "--costs", str(missing)]) == 2
    assert "nope.json" in capsys.readouterr().err
    assert main(["plan", "--lengths", "5", "--model-config", str(missing)]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["plan"]) == 2  # --lengths is required
    assert main(["plan", "--lengths", "5", "--prefill-max-tokens", "10", "--no-prefill-limit"]) == 2
    assert main(["plan", "--lengths", "5", "--max-tokens", "10", "--no-token-limit"]) == 2
    assert main(["plan", "--lengths", "5", "--continuous-batch-size", "0"]) == 2
    assert main(["plan", "--lengths", "5", "--capacity", "0"]) == 2
    capsys.readouterr()


def test_help_exits_0(capsys):
    assert main(["plan", "--help"]) == 0
    assert "--lengths" in capsys.readouterr().out


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """The real command line in a fresh process (`python -m autobucket.cli` is what the console script runs)."""
    return subprocess.run([sys.executable, "-m", "autobucket.cli", *argv], capture_output=True, text=True, timeout=60)


def test_module_entry_point_prints_json():
    completed = run_cli("plan", "--json", "--lengths", "512,16x31", "--packing", "none", *QWEN25_3B_FLAGS)
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout)
    assert result["route"] == "bucketed" and result["widths"] == [512, 16]
