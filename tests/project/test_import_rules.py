"""The package layout's import rules, checked on the source (AST), with negative controls.

Rules (docs/architecture.md):
1. `planning` and the cost model's formulas (`costs.coefficients`) are pure: standard library only, and from
   autobucket only `checks`, `planning` and `costs.coefficients`.
2. `costs` imports nothing from engine, calibration, tools, cli, distributed, integrations or serving;
   calibration (`costs.calibration`, which times the engine's own steps) is its one part that uses the engine.
3. `engine` imports nothing from calibration, tools, cli, distributed, integrations or serving.
4. Nothing outside `cli` imports `cli`.
5. No module imports another module's `_private` name.
6. No import cycles between modules (function-level imports count: a lazy import still couples).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "src" / "autobucket"
STDLIB = set(sys.stdlib_module_names) | {"__future__"}
FORBIDDEN = {
    "costs": {"engine", "calibration", "tools", "cli", "distributed", "integrations", "serving"},
    "engine": {"calibration", "tools", "cli", "distributed", "integrations", "serving"},
}
# Modules whose layer is not their package's (rules 1 and 2).
LAYER_OF_PREFIX = {"autobucket.costs.coefficients": "planning", "autobucket.costs.calibration": "calibration"}


def package_sources(root: Path = PACKAGE_ROOT) -> dict[str, str]:
    """Module name ("autobucket.engine.routes"; a package is its `__init__`) -> source text."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("autobucket", *path.relative_to(root).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        sources[name] = path.read_text()
    return sources


def imports_of(module: str, source: str, modules: set[str]) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every import statement, at any depth."""
    found: list[tuple[str, str | None]] = []
    package = module if _is_package(module, modules) else module.rpartition(".")[0]
    for node in ast.walk(_checked_tree(module, ast.parse(source))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule, None) if submodule in modules else (base, alias.name))
    return found


def _checked_tree(module: str, tree: ast.Module) -> ast.Module:
    """The tree without the package root's `if TYPE_CHECKING:` block: it names, for type checkers only, the
    public surface that the root's lazy `__getattr__` resolves (invisible here too), and never runs.
    Anywhere else a TYPE_CHECKING import counts like any other."""
    if module != "autobucket":
        return tree
    body = [node for node in tree.body if not (isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")]
    return ast.Module(body=body, type_ignores=[])


def _is_package(module: str, modules: set[str]) -> bool:
    return any(other.startswith(module + ".") for other in modules)


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def layer(module: str) -> str:
    """The layer a module belongs to: its package ("engine", "costs", …) unless `LAYER_OF_PREFIX` places it,
    or its own name at the top."""
    for prefix, placed in LAYER_OF_PREFIX.items():
        if module == prefix or module.startswith(prefix + "."):
            return placed
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(sources: dict[str, str]) -> list[str]:
    modules = set(sources)
    problems: list[str] = []
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module, source in sources.items():
        for target, name in imports_of(module, source, modules):
            problems += _rule_violations(module, target, name)
            if target in modules and target != module:
                graph[module].add(target)
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _rule_violations(module: str, target: str, name: str | None) -> list[str]:
    problems = []
    source_layer, top = layer(module), target.split(".")[0]
    internal = top == "autobucket"
    target_layer = layer(target) if internal else ""
    if source_layer == "planning":
        if not internal and top not in STDLIB:
            problems.append(f"{module} (planning) imports third-party {target}")
        if internal and target != "autobucket" and target_layer not in ("planning", "checks"):
            problems.append(f"{module} (planning) imports {target}")
    if internal and target_layer in FORBIDDEN.get(source_layer, ()):
        problems.append(f"{module} ({source_layer}) imports {target}")
    if internal and target_layer == "cli" and source_layer != "cli":
        problems.append(f"{module} imports the command line ({target})")
    if internal and name is not None and name.startswith("_") and not name.startswith("__") and target != module:
        problems.append(f"{module} imports private {target}.{name}")
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_package_follows_its_import_rules():
    sources = package_sources()
    assert {"autobucket.planning.planner", "autobucket.engine.routes", "autobucket.cli.main"} <= set(sources)
    assert violations(sources) == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("autobucket.planning.bad", "import torch\n", "planning) imports third-party torch"),
        ("autobucket.planning.bad", "import numpy as np\n", "planning) imports third-party numpy"),
        ("autobucket.planning.bad", "from autobucket.engine.routes import ROUTES\n", "(planning) imports autobucket.engine"),
        ("autobucket.engine.bad", "def f():\n    from autobucket.tools import sweep\n", "(engine) imports autobucket.tools.sweep"),
        ("autobucket.engine.bad", "from autobucket.costs.calibration import calibrate\n", "(engine) imports autobucket.costs.calibration"),
        ("autobucket.engine.bad", "from autobucket.costs.calibration.measure import calibrate\n", "(engine) imports autobucket.costs.calibration"),
        ("autobucket.costs.bad", "from autobucket.engine import routes\n", "(costs) imports autobucket.engine"),
        ("autobucket.costs.bad", "from autobucket.costs.calibration.timing import spread\n", "(costs) imports autobucket.costs.calibration"),
        ("autobucket.costs.coefficients", "import numpy\n", "(planning) imports third-party numpy"),
        ("autobucket.planning.bad", "from autobucket.costs.fit import fit_costs\n", "(planning) imports autobucket.costs.fit"),
        ("autobucket.tools.bad", "from autobucket.cli.args import positive_int\n", "imports the command line"),
        ("autobucket.engine.bad", "from autobucket.engine.routes import _record_cache\n", "imports private"),
        ("autobucket.engine.bad", "from . import routes\nfrom .routes import _check_sliding_window\n", "imports private"),
    ],
)
def test_a_deliberate_violation_is_reported(module, source, expected):
    sources = {**package_sources(), module: source}
    found = violations(sources)
    assert any(expected in problem for problem in found), found


def test_a_deliberate_cycle_is_reported():
    sources = package_sources()
    sources["autobucket.engine.cycle_a"] = "from autobucket.engine import cycle_b\n"
    sources["autobucket.engine.cycle_b"] = "def f():\n    import autobucket.engine.cycle_a\n"
    assert "import cycle: autobucket.engine.cycle_a -> autobucket.engine.cycle_b" in violations(sources)


def test_a_type_checking_import_outside_the_package_root_still_counts():
    sources = package_sources()
    sources["autobucket.engine.cycle_a"] = "from autobucket.engine import cycle_b\n"
    sources["autobucket.engine.cycle_b"] = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import autobucket.engine.cycle_a\n"
    assert "import cycle: autobucket.engine.cycle_a -> autobucket.engine.cycle_b" in violations(sources)
