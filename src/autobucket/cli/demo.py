"""`autobucket demo`: arguments -> `DemoConfig` -> `run_demo`; the report printed as rich tables.

torch and transformers are imported only by the handler, so registering this command keeps
`autobucket plan` torch-free."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

_WHAT_RAN = {
    "ordinary": "HF generate, one padded batch",
    "equal_width": "CB, one padded prefill",
    "aligned": "CB, one prefill per prompt",
    "hf_generate_batch": "transformers' own CB",
}


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from autobucket.cli.args import (
        OVERRIDE_PHRASE,
        add_alias,
        add_threads_argument,
        costs_argument,
        finish_parser,
        positive_int,
    )

    parser = subparsers.add_parser(
        "demo",
        help="run every route on the embedded SmolLM2 and a long-tail prompt set; table + plot",
        description="Times ordinary generate, the CB routes, auto and transformers' generate_batch on "
        "SmolLM2-135M-Instruct with 16 chat prompts (12 short questions, 4 HumanEval functions), checks "
        "that they agree token for token (exit status 1 if not) and writes a PNG plot and the raw numbers "
        "as JSON.",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("results/demo"), help="default: results/demo")
    parser.add_argument("--max-new-tokens", type=positive_int, default=48, metavar="N", help="default: 48")
    parser.add_argument(
        "--costs",
        type=costs_argument,
        metavar="FILE|online",
        help="calibration or coefficients JSON for the auto route, or online (default)",
    )
    parser.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="use a --costs calibration measured on another model, dtype, device or attention "
        "backend (warns)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        metavar="N",
        help="timed runs per route, interleaved; medians are shown (default: 1)",
    )
    parser.add_argument(
        "--no-hf-batch", dest="with_hf_batch", action="store_false", help="skip transformers' generate_batch"
    )
    add_alias(parser, "--no-hf-baseline", "--no-hf-batch", "with_hf_batch", nargs=0, const=False)
    add_threads_argument(parser)
    finish_parser(parser, _run_demo, phrases={OVERRIDE_PHRASE: "pass --allow-mismatch"})


def _run_demo(args: argparse.Namespace) -> int:
    from autobucket.cli.args import ONLINE_COSTS, apply_threads
    from autobucket.cli.console import report_console
    from autobucket.tools.demo import DemoConfig, run_demo

    costs = None if args.costs == ONLINE_COSTS else args.costs  # DemoConfig: None is learned online
    config = DemoConfig(args.out_dir, args.max_new_tokens, costs, args.repeats, args.with_hf_batch,
                        allow_mismatch=args.allow_mismatch)
    apply_threads(args)
    console = report_console()
    report = run_demo(config, lambda message: console.print(f"[dim]{message}...[/dim]"))
    _print_report(console, report)
    return 0 if report.all_agree else 1


def _print_report(console: Any, report: Any) -> None:
    from rich.panel import Panel

    table, legend = _timing_table(report, console.width)
    console.print(table)
    for line in legend:
        console.print(line)
    console.print(_auto_line(report))
    console.print(_agreement_line(report))
    for prompt, completion in report.samples:
        body = f"[bold]prompt[/bold] ({len(prompt.ids)} tokens): {_clip(prompt.text, 160)}\n\n{completion}"
        console.print(Panel(body, title=f"sample completion: {prompt.id}", title_align="left"))
    console.print(
        f"plot: {report.plot_path}; raw numbers: {report.json_path}; "
        f"demo took {report.total_s:.0f} s (model load {report.load_s:.1f} s)"
    )


def _timing_table(report: Any, width: int) -> tuple[Any, list[str]]:
    """One row per contender, laid out for `width` columns, and the lines to print under it. Where the
    whole table is wider, its prose column ("what ran") becomes those lines and each other column is as
    wide as its longest figure, name or header word: figures stay whole, headers wrap between words."""
    rows = {name: _timing_cells(name, timing, report) for name, timing in report.timings.items()}
    table = _new_timing_table(report)
    for column in _COLUMNS:
        table.add_column(column, justify="left" if column in ("route", "what ran") else "right")
    for name, cells in rows.items():
        table.add_row(*cells, style="bold green" if name == "auto" else None)
    if Console(width=_UNLIMITED).measure(table).maximum <= width:
        return table, []
    narrow = _new_timing_table(report)
    for index, column in enumerate(_COLUMNS[:-1]):
        words = [word for text in (column, *(cells[index] for cells in rows.values())) for word in text.split()]
        narrow.add_column(column, justify="left" if column == "route" else "right", width=max(map(len, words)))
    for name, cells in rows.items():
        narrow.add_row(*cells[:-1], style="bold green" if name == "auto" else None)
    return narrow, [f"{name} ran {cells[-1]}" for name, cells in rows.items()]


def _new_timing_table(report: Any) -> Any:
    from rich.table import Table

    lengths = sorted(len(p.ids) for p in report.prompts)
    repeats = "one timed run" if report.config.repeats == 1 else f"median of {report.config.repeats} runs"
    return Table(
        title=f"SmolLM2-135M-Instruct, {len(lengths)} chat prompts of {lengths[0]}-{lengths[-1]} tokens, "
        f"<= {report.config.max_new_tokens} new tokens ({repeats} per route after a warm-up)",
        caption=f"auto's costs: {report.costs_label}",
    )


_UNLIMITED = 10_000  # a console width no table reaches: measures its one-line width
_COLUMNS = ("route", "time s", "tok/s", "vs ordinary", "same tokens", "prefill positions", "what ran")


def _timing_cells(name: str, timing: Any, report: Any) -> list[str]:
    """One contender's row, in `_COLUMNS` order."""
    return [
        name,
        f"{timing.median_ms / 1e3:.2f}",
        f"{timing.tokens_per_s:.1f}",
        f"{report.speedup(name):.2f}x",
        f"{timing.matching_prompts}/{len(report.prompts)}",
        str((timing.profile or {}).get("prefill_tokens", "")),
        _what_ran(name, timing, report),
    ]


def _what_ran(name: str, timing: Any, report: Any) -> str:
    if name != "auto":
        return _WHAT_RAN.get(name, "")
    route = (timing.profile or {}).get("route", "?")
    return f"{route}: " + " ".join(f"{rows}x{width}" for rows, width in report.auto_widths())


def _auto_line(report: Any) -> str:
    profile = report.timings["auto"].profile or {}
    ordinary, bucketed = profile.get("estimated_ordinary_ms"), profile.get("estimated_bucketed_ms")
    estimates = f"cost-model estimates: ordinary {_ms(ordinary)}, bucketed {_ms(bucketed)}"
    return (
        f"[bold]auto[/bold] chose [bold]{profile.get('route', '?')}[/bold] ({estimates}): "
        f"{report.speedup('auto'):.2f}x the speed of ordinary generate"
    )


def _agreement_line(report: Any) -> str:
    from autobucket.tools.wording import counted

    count = len(report.prompts)
    if report.all_agree:
        return (
            f"[green]token for token: all {len(report.timings)} contenders produced the same tokens as ordinary "
            f"generate for all {count} prompts[/green]"
        )
    differing = [
        f"{name} ({counted(count - t.matching_prompts, 'prompt')})"
        for name, t in report.timings.items()
        if t.matching_prompts != count
    ]
    return f"[red]tokens differ from ordinary generate: {', '.join(differing)} (see demo.json)[/red]"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} ms"


def _clip(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
