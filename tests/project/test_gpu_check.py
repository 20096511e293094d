"""`benchmarks/gpu_check.sh --rehearse`: the GPU check's phases and code paths on the CPU at toy sizes (the
Triton kernels under the interpreter, forced onto CPU tensors), so a typo never costs GPU time. It must
say what it runs and the versions it found, finish every phase, judge the kernels invariant with controls
that broke, and find zero mismatch for the invariant kernels where the default kernels' is not zero. Its
floor check must name what an environment lacks of pyproject's requirements."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

REPO = Path(__file__).resolve().parents[2]


def test_the_rehearsal_runs_every_phase_and_passes(tmp_path):
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--rehearse", str(tmp_path / "out")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rehearsal on the CPU" in done.stdout and "floors: pyproject.toml's requirements" in done.stdout
    assert f"python {platform.python_version()}" in done.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert all(summary[phase]["ok"] for phase in ("env", "kernels", "mismatch", "speed", "step")), summary
    kernels = summary["kernels"]["results"]
    assert {name.split("/")[0] for name in kernels} == {"linear", "attention", "shared_prefix", "rows"}
    assert all(r["differing"] == 0 and r["control_differing"] > 0 for r in kernels.values())
    mismatch = summary["mismatch"]["results"]
    assert mismatch["invariant"]["max_abs_logp_diff"] == 0.0 and mismatch["invariant"]["tokens"] > 0
    assert mismatch["torch"]["max_abs_logp_diff"] > 0.0  # control: the default kernels' trainer forward differs
    assert set(summary["speed"]["median_s"]) == {
        "hf_generate", "auto_default_eager", "auto_default_graphs", "auto_invariant_eager", "auto_invariant_graphs"
    }  # fmt: skip
    steps = summary["step"]["results"]
    assert all(r["forms"] == ["engine", "captured"] and r["captures"] == 1 for r in steps.values())
    assert steps["invariant"]["logits_equal"]  # the graph replays the eager step's kernels
    assert "DeprecationWarning" not in "".join(p.read_text() for p in (tmp_path / "out").glob("*.log"))
    assert "kernels" in (tmp_path / "out" / "table.txt").read_text()


def test_the_floor_check_names_what_the_environment_lacks():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    python_spec, dependencies = gpu_check.declared_floors()
    assert any(line.startswith("torch") for line in dependencies)
    assert gpu_check.floor_problems(python_spec, dependencies) == []  # this venv is a tested one
    problems = gpu_check.floor_problems(">=99", ["torch>=99", "no-such-package-here>=1"])
    assert problems[0].startswith(f"python {platform.python_version()} does not satisfy requires-python >=99")
    assert problems[1].startswith("torch ") and problems[1].endswith("does not satisfy torch>=99")
    assert problems[2] == "no-such-package-here is not installed (pyproject: no-such-package-here>=1)"
