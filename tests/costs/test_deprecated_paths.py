"""The cost model's old module paths still import for one release: each warns, naming the new path, and
re-exports the very objects of `autobucket.costs`. Every module of `autobucket.costs` imports on its own."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import autobucket.costs.calibration as calibration
import autobucket.costs.calibration_file as calibration_file

PACKAGE_ROOT = Path(calibration_file.__file__).parents[1]
COST_MODULES = sorted(
    ".".join(("autobucket", *path.relative_to(PACKAGE_ROOT).with_suffix("").parts)).removesuffix(".__init__")
    for path in (PACKAGE_ROOT / "costs").rglob("*.py")
)
OLD_PATHS = [
    ("autobucket.coefficients", calibration_file, "autobucket.costs.calibration_file"),
    ("autobucket.calibration", calibration, "autobucket.costs.calibration"),
]


def fresh_import(name: str):
    """Import `name` as a first import would: the warning fires once, when the module first runs."""
    sys.modules.pop(name, None)
    return importlib.import_module(name)


@pytest.mark.parametrize(("old", "new", "new_name"), OLD_PATHS, ids=[old for old, _, _ in OLD_PATHS])
def test_an_old_path_warns_and_re_exports_the_new_objects(monkeypatch, old, new, new_name):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated.*{new_name}"):
        module = fresh_import(old)
    assert module.__all__
    for name in module.__all__:
        assert getattr(module, name) is getattr(new, name), name


def run_python(code: str, *warning_filters: str) -> subprocess.CompletedProcess:
    flags = [arg for spec in warning_filters for arg in ("-W", spec)]
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True)


@pytest.mark.parametrize("module", COST_MODULES)
def test_each_cost_module_imports_first_in_a_fresh_process_without_a_deprecation_warning(module):
    """Imported before anything else: a cycle through a package's `__init__` fails only in this order."""
    run = run_python(f"import {module}", "error::DeprecationWarning:autobucket")
    assert run.returncode == 0, run.stderr


def test_control_an_old_path_fails_the_same_check():
    run = run_python("import autobucket.coefficients", "error::DeprecationWarning")
    assert "DeprecationWarning: autobucket.coefficients is deprecated" in run.stderr
