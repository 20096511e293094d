"""The tests' own layout, checked on the tree (AST), with negative controls.

1. Every test module sits in a folder (planning, costs, engine/..., integrations, cli, properties,
   project), none directly in tests/.
2. Test module names are unique across folders: the folders are not packages, so pytest imports each
   test module under its bare name, and a second module of that name fails to collect.
3. No test imports from a conftest: pytest imports every folder's conftest.py under the one name
   `conftest`, so `from conftest import` reads whichever was imported last. Shared helpers live in the
   plain modules beside the root conftest.py (oracles, workloads, byte_tokenizer, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS_ROOT = Path(__file__).resolve().parents[1]


def find_test_modules(root: Path) -> list[Path]:
    return sorted(root.rglob("test_*.py"))


def modules_outside_folders(root: Path) -> list[str]:
    return [path.name for path in find_test_modules(root) if path.parent == root]


def duplicate_module_names(root: Path) -> list[str]:
    """'name: folder, folder' for every test module name that more than one folder holds."""
    folders: dict[str, list[str]] = {}
    for path in find_test_modules(root):
        folders.setdefault(path.name, []).append(str(path.parent.relative_to(root)))
    return [f"{name}: {', '.join(places)}" for name, places in folders.items() if len(places) > 1]


def conftest_imports(root: Path) -> list[str]:
    """'path:line' of every `import conftest` or `from conftest import` in a test module."""
    found = []
    for path in find_test_modules(root):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module == "conftest" or "conftest" in names:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_test_module_sits_in_a_folder():
    outside = modules_outside_folders(TESTS_ROOT)
    assert not outside, f"move {outside} into the folder of what they test (tests/<package>/...)"


def test_test_module_names_are_unique_across_folders():
    duplicates = duplicate_module_names(TESTS_ROOT)
    assert not duplicates, f"{duplicates}: rename all but one of each (pytest imports them by bare name)"


def test_no_test_imports_from_a_conftest():
    found = conftest_imports(TESTS_ROOT)
    assert not found, f"{found} import from conftest: import from tests/oracles.py, workloads.py, ... instead"


def test_each_check_finds_what_it_forbids(tmp_path: Path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "cli").mkdir()
    (tmp_path / "test_flat.py").write_text("import conftest\n")
    (tmp_path / "engine" / "test_same.py").write_text("def f():\n    from conftest import random_prompts\n")
    (tmp_path / "cli" / "test_same.py").write_text("from workloads import random_prompts\n")
    assert modules_outside_folders(tmp_path) == ["test_flat.py"]
    assert duplicate_module_names(tmp_path) == ["test_same.py: cli, engine"]
    assert conftest_imports(tmp_path) == ["engine/test_same.py:2", "test_flat.py:1"]
