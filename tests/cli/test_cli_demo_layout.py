"""`autobucket demo`'s report laid out for the width it has: in an 80-column terminal and in a pipe every
column's header and every figure the demo computed is printed whole.

The report is a `DemoReport` with the demo's own contenders and prompt set shape; its figures are what
`RouteTiming` and `DemoReport` compute from the timed samples (the oracle: they appear, whole, on their
route's line). Control: the wide layout printed in 80 columns loses them."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from autobucket.cli import demo as demo_cli
from autobucket.cli.console import LOG_WIDTH, report_console
from autobucket.costs.coefficients import CostCoefficients
from autobucket.tools.demo import DemoConfig, DemoPrompt, DemoReport, RouteTiming

HEADERS = ("route", "time s", "tok/s", "vs ordinary", "same tokens", "prefill positions", "what ran")
SAMPLES_MS = {"ordinary": [41234.5, 40987.1, 41502.9], "equal_width": [30123.4, 30333.3, 29876.5],
              "aligned": [15234.9, 15111.2, 15420.0], "auto": [14876.1, 14901.7, 14850.3],
              "hf_generate_batch": [25012.7, 25100.2, 24987.6]}  # fmt: skip


def demo_report() -> DemoReport:
    lengths = [38 + 3 * i for i in range(12)] + [82, 142, 166, 436]
    prompts = [DemoPrompt(f"q{i:02d}", f"question {i}", list(range(n))) for i, n in enumerate(lengths)]
    report = DemoReport(DemoConfig(repeats=3), prompts, CostCoefficients(), "learned online on this machine (probe)", 9.5)
    groups = [list(range(12)), [12, 13, 14], [15]]
    for name, samples in SAMPLES_MS.items():
        profile = None if name == "hf_generate_batch" else {"prefill_tokens": 7023 - len(name), "route": "bucketed",
                                                             "prefill_groups": [groups]}  # fmt: skip
        tokens = [[5] * (40 + i % 9) for i in range(len(prompts))]
        report.timings[name] = RouteTiming(name, samples, tokens, profile, 16 if name != "aligned" else 15)
    report.plot_path, report.json_path, report.total_s = Path("demo_times.png"), Path("demo.json"), 120.0
    return report


def row_figures(report: DemoReport, name: str) -> list[str]:
    """The figures of `name`'s row as the demo computes them (median, tokens/s, speed-up, agreement)."""
    timing = report.timings[name]
    prefill = (timing.profile or {}).get("prefill_tokens")
    return [f"{timing.median_ms / 1e3:.2f}", f"{timing.tokens_per_s:.1f}", f"{report.speedup(name):.2f}x",
            f"{timing.matching_prompts}/{len(report.prompts)}", *([str(prefill)] if prefill else [])]  # fmt: skip


def printed(console: Console, report: DemoReport) -> str:
    demo_cli._print_report(console, report)
    return console.file.getvalue()


def assert_every_figure_whole(text: str, report: DemoReport, width: int) -> None:
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    head = "\n".join(lines[: next(i for i, line in enumerate(lines) if "ordinary" in line and "│" in line)])
    for header in HEADERS[:-1]:
        assert all(word in head for word in header.split()), (header, head)
    assert "what ran" in text or all(f"{name} ran " in text for name in report.timings)
    for name in report.timings:
        rows = [line for line in lines if line.startswith(f"│ {name} ")]
        assert len(rows) == 1, (name, text)  # the route's name whole, on one line
        row = rows[0]
        cells = [cell.strip() for cell in row.strip("│").split("│")]
        assert cells[0] == name and cells[1 : 1 + len(row_figures(report, name))] == row_figures(report, name), row
    assert "auto ran bucketed: 12x71 3x166 1x436" in text or "bucketed: 12x71 3x166 1x436" in text


@pytest.mark.parametrize("width", [80, 100])
def test_a_terminal_of_80_columns_shows_every_header_and_figure(width):
    report = demo_report()
    text = printed(Console(width=width, file=io.StringIO(), highlight=False), report)
    assert_every_figure_whole(text, report, width)


def test_piped_the_report_is_one_wide_table(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    report = demo_report()
    console = report_console()
    assert not console.is_terminal and console.width == LOG_WIDTH
    console.file = io.StringIO()
    text = printed(console, report)
    assert_every_figure_whole(text, report, LOG_WIDTH)
    assert "what ran" in text.splitlines()[2]  # the prose column in the table, not under it
    monkeypatch.setenv("COLUMNS", "80")  # a user's own width wins
    assert report_console().width == 80


def test_control_the_wide_layout_in_80_columns_loses_figures():
    report = demo_report()
    wide, _ = demo_cli._timing_table(report, LOG_WIDTH)
    console = Console(width=80, file=io.StringIO(), highlight=False)
    console.print(wide)
    with pytest.raises(AssertionError):
        assert_every_figure_whole(console.file.getvalue(), report, 80)
