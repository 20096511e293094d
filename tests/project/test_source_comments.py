"""Comments that say what and why, checked on the source (tokens and AST), with negative controls.

1. No comment or docstring quotes a measurement (a duration, a speed ratio, a percentage change, a machine):
   figures live in docs/ and benchmark JSON, the source keeps the reason in words.
2. `# fmt: skip` marks only tables: a dict, list, set or tuple literal laid out by hand over several lines,
   or a Triton kernel's parameters and launch arguments grouped by role. Anything else is formatted like the rest of the code.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "src" / "autobucket"
FMT_SKIP = "# fmt: skip"
# A duration, a ratio ("2.6x", "5-10x"), a percentage change, or a machine named in a comment or docstring.
MEASUREMENT = re.compile(
    r"(?<![\w.])~?(?!0\s?ms\b)\d[\d,.]*(?:\s?[-–]\s?\d[\d,.]*)?\s?(?:ms|us|µs|ns|s|seconds|minutes|GB|GiB|GB/s|tok/s)(?![\w/])"
    r"|(?<![\w.])~?\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?[x×](?![\w])"
    r"|\d%\s+(?:faster|slower|more|less|fewer)\b"
    r"|\b(?:Xeon|EPYC|Zen ?\d|Ryzen|Sapphire Rapids|Graviton|this VM)\b"
)
def comment_and_docstring_lines(source: str) -> dict[int, str]:
    """Line number -> the comment or docstring text on that line."""
    lines = source.splitlines()
    found: dict[int, str] = {}
    for node in ast.walk(ast.parse(source)):
        documented = isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        if documented and ast.get_docstring(node, clean=False) is not None:
            first = node.body[0]
            for number in range(first.lineno, first.end_lineno + 1):
                found[number] = lines[number - 1]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = found.get(token.start[0], "") + token.string
    return found


def measurement_lines(source: str) -> list[int]:
    return sorted(
        number for number, text in comment_and_docstring_lines(source).items() if MEASUREMENT.search(text)
    )


def _is_kernel_signature(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list)


def fmt_skips_off_tables(source: str) -> list[int]:
    """Lines marked `# fmt: skip` that end no table: a dict, list, set or tuple literal over several lines
    (wherever it sits: an assignment, a return, an argument, a `for` header), or a Triton kernel's
    signature or launch arguments, grouped by role as the kernel's parameters are."""
    lines = source.splitlines()
    marked = {number for number, line in enumerate(lines, 1) if FMT_SKIP in line}
    tables: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Dict, ast.List, ast.Set, ast.Tuple)) and node.end_lineno > node.lineno:
            tables.add(node.end_lineno)
        if _is_kernel_signature(node):
            tables.add(node.body[0].lineno - 1)  # the line that closes the parameter list
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            tables.add(
                node.end_lineno
            )  # a kernel launch, `kernel[grid](...)`: its arguments as the signature's
    return sorted(marked - tables)


def package_sources() -> dict[str, str]:
    return {
        str(path.relative_to(PACKAGE_ROOT)): path.read_text() for path in sorted(PACKAGE_ROOT.rglob("*.py"))
    }


def test_no_comment_or_docstring_quotes_a_measurement():
    found = {
        name: measurement_lines(source)
        for name, source in package_sources().items()
    }
    assert {name: lines for name, lines in found.items() if lines} == {}, (
        "say why in words; figures go to docs/"
    )


def test_fmt_skip_marks_only_tables():
    found = {
        name: fmt_skips_off_tables(source)
        for name, source in package_sources().items()
    }
    assert {name: lines for name, lines in found.items() if lines} == {}, (
        "let ruff format lay out what is no table"
    )


def test_each_check_finds_what_it_forbids():
    quoted = [
        "# one large call was 2.6x faster",
        "# 0.4 ms a call on SmolLM2",
        "# 19% faster on bench-qwen2",
        "# (an Intel Xeon, one call)",
        '"""Loads in ~18 s."""',
        "# a 5-20x slowdown; about 1 GB",
    ]
    assert [measurement_lines(text + "\n") for text in quoted] == [[1]] * len(quoted)
    fine = [
        "# a 0 ms reading keeps a finite weight",
        "# transformers 4.57 and 5.x alike",
        "# [M, 1024] x [1024, 256]",
        '"""``"512,16x31"``: 31 prompts."""',
    ]
    assert [measurement_lines(text + "\n") for text in fine] == [[]] * len(fine)
    skipped = 'f(a,\n  b)  # fmt: skip\nTABLE = {"a": 1, "b": 2,\n         "c": 3}  # fmt: skip\ng((1, 2))  # fmt: skip\n'
    assert fmt_skips_off_tables(skipped) == [2, 5]
    kernel = "@triton.jit\ndef k(\n    x, y,\n    z,\n):  # fmt: skip\n    pass\nk[grid](\n    x, y,\n    z)  # fmt: skip\n"
    assert fmt_skips_off_tables(kernel) == []
    assert fmt_skips_off_tables(kernel.replace("@triton.jit\n", "").replace("k[grid]", "k")) == [4, 8]
