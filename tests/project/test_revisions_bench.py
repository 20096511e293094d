"""`benchmarks/revisions.py`, two git revisions' whole calls in one interleaved run.

The driving logic against scripted sides (no processes): a warm-up of every config, then rounds in ABBA
order; a config one side refuses is reported and not run again; tokens the sides disagree on are flagged;
the ratio and its verdict are HEAD's median over BASE's. Then the script itself at its smoke size against
this checkout's own commit: each worker imports autobucket from its own tree, the temporary worktree is
gone afterwards, one revision against itself agrees on every token, and a refused config is a row, not
a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autobucket import SamplingConfig

REPO = Path(__file__).resolve().parents[2]
_saved_path = list(sys.path)
sys.path.insert(0, str(REPO / "benchmarks"))
import revisions  # noqa: E402

sys.path[:] = _saved_path  # the script's folders stay off this process's path


class ScriptedSide:
    """A side that records every call and answers from `answer(config, request)`."""

    def __init__(self, name: str, log: list, answer) -> None:
        self.name, self.log, self.answer = name, log, answer

    def call(self, config: dict, request: dict) -> dict:
        self.log.append((self.name, config.get("kernels"), request["turns"][0][0][0]))
        return {"warnings": [], **self.answer(config, request)}


def timed(ms: float, tokens: object = ((1, 2),)) -> dict:
    return {"ms": ms, "tokens": tokens}


def workload() -> revisions.Workload:
    return revisions.Workload("w", {"route": "auto"}, lambda seed: {"sampling": {}, "turns": [[[seed]]]})


PAIRINGS = [revisions.Pairing("a", {"kernels": "a"}, {"kernels": "a"}, same_tokens=True),
            revisions.Pairing("b", {"kernels": "b"}, {"kernels": "b2"})]  # fmt: skip


def test_a_request_names_only_the_fields_it_changes_and_rebuilds_the_same_config():
    sampling = SamplingConfig(max_new_tokens=5, eos_token_id=[], n=2, temperature=1.0, seed=3)
    fields = revisions.changed_fields(sampling)
    assert set(fields) == {"max_new_tokens", "eos_token_id", "n", "temperature", "seed"}
    assert SamplingConfig(**json.loads(json.dumps(fields))) == sampling
    assert revisions.changed_fields(SamplingConfig()) == {}  # control: nothing changed, nothing named


def test_every_config_warms_up_on_both_sides_then_rounds_alternate_which_side_runs_first():
    log: list = []
    sides = {name: ScriptedSide(name, log, lambda config, request: timed(1.0)) for name in revisions.SIDES}
    revisions.run_workload(sides, workload(), PAIRINGS, rounds=2, seed=7)
    warm = revisions.WARMUP_SEED + 7
    assert log == [("base", "a", warm), ("head", "a", warm), ("base", "b", warm), ("head", "b2", warm),
                   ("base", "a", 7), ("head", "a", 7), ("base", "b", 7), ("head", "b2", 7),
                   ("head", "a", 8), ("base", "a", 8), ("head", "b2", 8), ("base", "b", 8)]  # fmt: skip


def test_a_config_one_side_refuses_is_reported_and_not_run_again_while_the_others_are_measured():
    log: list = []

    def head(config, request):
        return {"error": "ValueError: kernels='b2' is invalid"} if config["kernels"] == "b2" else timed(2.0)

    sides = {"base": ScriptedSide("base", log, lambda config, request: timed(1.0)), "head": ScriptedSide("head", log, head)}
    measured = {m.pairing.name: m for m in revisions.run_workload(sides, workload(), PAIRINGS, rounds=2, seed=0)}
    assert measured["b"].errors == {"head": "ValueError: kernels='b2' is invalid"}
    assert [call for call in log if call[1] in ("b", "b2")] == [("base", "b", revisions.WARMUP_SEED), ("head", "b2", revisions.WARMUP_SEED)]
    assert measured["a"].samples_ms == {"base": [1.0, 1.0], "head": [2.0, 2.0]} and not measured["a"].errors
    row = revisions.summary(measured["b"])
    assert "ratio" not in row and row["errors"]["head"].startswith("ValueError")


def test_tokens_the_sides_disagree_on_are_flagged_where_they_should_agree(capsys):
    def head(config, request):
        return timed(1.0, [[9]] if request["turns"][0][0][0] == 1 else [[1, 2]])

    sides = {"base": ScriptedSide("base", [], lambda config, request: timed(1.0, [[1, 2]])), "head": ScriptedSide("head", [], head)}
    measured = revisions.run_workload(sides, workload(), PAIRINGS, rounds=2, seed=0)
    assert [m.tokens_equal for m in measured] == [[True, False], [True, False]]
    rows = [revisions.summary(m) for m in measured]
    assert revisions.tokens_cell(rows[0], same_tokens=True) == "DISAGREE: 1 of 2 rounds"
    assert revisions.tokens_cell(rows[1], same_tokens=False) == "differ: 1 of 2 rounds"
    pairings = {p.name: p for p in PAIRINGS}
    capsys.readouterr()  # the rounds' progress lines
    revisions.print_agreement(rows, pairings)
    assert capsys.readouterr().out == "tokens: the sides DISAGREE where they should agree: w / a\n"  # not b: it may differ
    rows[0]["tokens_equal_rounds"] = [True, True]  # control: agreement reads as agreement
    assert revisions.tokens_cell(rows[0], same_tokens=True) == "yes"
    revisions.print_agreement(rows, pairings)
    assert capsys.readouterr().out == "tokens: the sides agree in every round of the 1 workload / config pairs that should agree\n"


@pytest.mark.parametrize(("head_ms", "target", "expected"), [
    ((10.1, 10.3), ("within", 0.03), "met (within 0.03)"),
    ((10.5, 10.7), ("within", 0.03), "NOT met (within 0.03)"),
    ((9.5, 9.9), ("within", 0.03), "NOT met (within 0.03)"),
    ((9.9, 10.1), ("at most", 1.0), "met (at most 1)"),
    ((10.1, 10.1), ("at most", 1.0), "NOT met (at most 1)"),
])  # fmt: skip
def test_the_ratio_is_heads_median_over_bases_and_its_verdict_follows_the_target(head_ms, target, expected):
    entry = revisions.Measured("w", revisions.Pairing("p", {}, {}, target))
    entry.samples_ms = {"base": [10.0, 10.0], "head": list(head_ms)}
    row = revisions.summary(entry)
    assert row["ratio"] == pytest.approx(sum(head_ms) / 2 / 10.0)
    assert row["round_ratios"] == pytest.approx([ms / 10.0 for ms in head_ms])
    assert row["verdict"] == expected


def test_the_smoke_run_against_this_commit_loads_each_tree_and_reports_a_refused_config(tmp_path):
    out = tmp_path / "revisions.json"
    command = [sys.executable, str(REPO / "benchmarks" / "revisions.py"), "--base", "HEAD", "--size", "smoke",
               "--model", "tiny-qwen2", "--workloads", "bench-peers short tail", "--out", str(out),
               "--config", "invariant", '{"kernels": "invariant"}',
               "--config", "refused by head", "{}", '{"kernels": "no-such-kernels"}']  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    base_file, head_file = Path(report["sides"]["base"]["autobucket"]), Path(report["sides"]["head"]["autobucket"])
    assert head_file.is_relative_to(REPO / "src")
    assert not base_file.is_relative_to(REPO) and not base_file.exists()  # its own worktree, removed after
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    assert str(base_file.parents[2]) not in worktrees
    rows = {row["config"]: row for row in report["rows"]}
    assert rows["invariant"]["tokens_equal_rounds"] == [True, True] and not rows["invariant"]["errors"]
    assert [len(rows["invariant"]["samples_ms"][side]) for side in revisions.SIDES] == [2, 2]
    assert list(rows["refused by head"]["errors"]) == ["head"] and "no-such-kernels" in rows["refused by head"]["errors"]["head"]
    assert "| bench-peers short tail (1x20 + 31x1) | invariant |" in done.stdout


def test_the_target_line_counts_the_workloads_that_met_it_and_names_the_others(capsys):
    pairing = revisions.Pairing("p", {}, {}, ("within", 0.03))
    rows = []
    for name, head_ms in (("w1", 10.1), ("w2", 11.0), ("refused", None)):
        entry = revisions.Measured(name, pairing)
        entry.samples_ms = {"base": [10.0], "head": [head_ms] if head_ms else []}
        rows.append(revisions.summary(entry))
    revisions.print_targets(rows, {"p": pairing})
    assert capsys.readouterr().out == "target 'p': head / base within 0.03 on 1 of 2 workloads; not on w2 1.100\n"
    revisions.print_targets(rows[2:], {"p": pairing})
    assert capsys.readouterr().out == "target 'p': not measured (refused or failed on every workload)\n"


@pytest.mark.parametrize("rounds", ["0", "3"])
def test_an_odd_or_empty_round_count_is_refused_before_anything_starts(rounds, capsys):
    with pytest.raises(SystemExit):
        revisions.parse(["--base", "HEAD", "--rounds", rounds])
    assert f"--rounds {rounds}: ABBA rounds come in pairs" in capsys.readouterr().err
    assert revisions.parse(["--base", "HEAD", "--rounds", "4"]).rounds == 4  # control: an even count is taken
