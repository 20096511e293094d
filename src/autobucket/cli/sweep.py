"""``autobucket sweep``: every route on a set of workloads with one calibration; Auto / best per workload.

Torch, transformers and matplotlib are imported inside the handler only. Exit status: 0 (the report
says how Auto did), 2 usage error (including a calibration that does not match the model).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from autobucket.cli.args import (
    OVERRIDE_PHRASE,
    add_alias,
    add_model_arguments,
    finish_parser,
    load_model_from_args,
    parse_lengths,
    positive_int,
)
from autobucket.cli.console import progress_bar, report_console


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="time every route on many workloads with one calibration and report Auto / best",
        description="Run ordinary, equal_width, aligned, auto (and HF generate_batch) on each workload: "
        "one warm-up, interleaved repeats, token agreement, Auto / best manual route.",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--costs",
        default="online",
        help="calibration JSON (autobucket calibrate), or 'online' (default): Auto learns from its own calls "
        "and --plot also draws its learning curve",
    )
    parser.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="use a --costs calibration measured on another model, dtype, device or attention backend (warns)",
    )
    parser.add_argument(
        "--workloads",
        type=lambda text: [w.strip() for w in text.split(",") if w.strip()],
        metavar="NAME,...",
        help="workload keys or groups: all (default), reference, humaneval, none, or e.g. long-tail,spread",
    )
    parser.add_argument(
        "--lengths",
        type=parse_lengths,
        action="append",
        default=[],
        metavar="L,LxN,...",
        help="an extra workload of these prompt lengths (repeatable), e.g. 512,16x31",
    )
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs per contender")
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=16,
        metavar="N",
        help="new tokens per prompt (default: 16)",
    )
    parser.add_argument(
        "--continuous-batch-size",
        type=positive_int,
        default=32,
        metavar="N",
        help="most rows decoded at once, every route (default: 32)",
    )
    add_alias(parser, "--batch-size", "--continuous-batch-size", "continuous_batch_size", type=positive_int)
    parser.add_argument("--no-hf-batch", action="store_true", help="skip transformers' generate_batch")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the prompts' random token ids and of the HumanEval sample (default 0)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("sweep.json"),
        metavar="FILE",
        help="report JSON with the raw samples (default: sweep.json in the current folder)",
    )
    parser.add_argument("--plot", type=Path, help="PNG of ms per route per workload")
    finish_parser(parser, _run_sweep, phrases={OVERRIDE_PHRASE: "pass --allow-mismatch"})


def _run_sweep(args: argparse.Namespace) -> int:
    from autobucket.costs.calibration_file import calibration_metadata, load_calibration
    from autobucket.tools.baselines import has_generate_batch
    from autobucket.tools.sweep import HF_BATCH, SweepOptions, plot_sweep, run_sweep, select_workloads

    options = SweepOptions(repeats=args.repeats, max_new_tokens=args.max_new_tokens, seed=args.seed,
                           continuous_batch_size=args.continuous_batch_size, with_hf_batch=not args.no_hf_batch)
    if args.out.is_dir():
        raise ValueError(f"cannot write --out {str(args.out)!r}: it is a folder; name a .json file")
    model, tokenizer = load_model_from_args(args)
    workloads, notes = select_workloads(args.workloads, tokenizer, args.lengths, args.seed)
    if not workloads:
        raise ValueError("no workloads selected: pass --workloads and/or --lengths")
    for note in notes:  # said before the long part, e.g. that lengths are estimated without a tokenizer
        Console(stderr=True).print(f"note: {note}", highlight=False)
    online = args.costs == "online"
    costs = "online" if online else load_calibration(Path(args.costs), model=model, strict=not args.allow_mismatch)
    contenders = 4 + (options.with_hf_batch and has_generate_batch(model))
    # said before the long part, and the default file lands in whatever folder the user is in
    Console(stderr=True).print(
        f"sweep: the report goes to {args.out.resolve()} when it ends (--out FILE to choose)",
        highlight=False,
        soft_wrap=True,
    )
    with progress_bar(len(workloads) * contenders * (options.warmup + options.repeats), "sweeping") as step:
        report = run_sweep(model, costs, workloads, options, progress=step)
    notes += report["notes"]
    report["metadata"] = {
        **calibration_metadata(model, args.model),
        "costs_file": str(args.costs),
        "notes": notes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_sweep(report, str(args.plot), title=plot_title(report, args.model, args.dtype))
        if online:
            from autobucket.tools.learning_curve import plot_learning_curve

            curve_path = args.plot.with_name(f"{args.plot.stem}-learning{args.plot.suffix}")
            plot_learning_curve(report["learning_curve"], str(curve_path))
            print(f"wrote {curve_path}")
    _print_report(report, HF_BATCH, notes)
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def plot_title(report: dict[str, Any], model: str, dtype: str) -> str:
    metadata, options = report["metadata"], report["options"]
    return (
        f"autobucket sweep: {model} ({dtype}, {metadata['device']}, {metadata['threads']} thread(s)), "
        f"{options['max_new_tokens']} new tokens\nmedian ms per call; black edge: best manual route"
    )


def _print_report(report: dict[str, Any], hf_name: str, notes: list[str]) -> None:
    from autobucket.tools.sweep import auto_choice_text

    console = report_console()
    console.print(sweep_table(report, auto_choice_text))
    summary = report["summary"]
    console.print(
        f"worst Auto / best manual: {summary['worst_auto_over_best']:.3f} ({summary['worst_workload']}); "
        f"all tokens match ordinary: {summary['all_tokens_match']}",
        highlight=False,
    )
    for route, keys in summary["routes_chosen"].items():
        console.print(f"Auto chose {route} on: {', '.join(keys) or '(none)'}", highlight=False)
    if not summary["both_routes_chosen"]:
        console.print(
            "[yellow]warning: Auto chose only one route on these workloads; the sweep does not "
            "exercise both decisions[/yellow]"
        )
    for note in notes:
        console.print(f"note: {note}", highlight=False)


def sweep_table(report: dict[str, Any], choice_text) -> Table:
    workloads = report["workloads"]
    names = list(workloads[0]["contenders"]) if workloads else []
    table = Table(title="Sweep: median ms per generate call (mean in the JSON)")
    table.add_column("workload")
    for name in names:
        table.add_column(name, justify="right")
    for column in ("auto choice", "auto / best", "tokens"):
        table.add_column(column, justify="left" if column == "auto choice" else "right")
    for workload in workloads:
        cells = []
        for name in names:
            text = f"{workload['contenders'][name]['median_ms']:.1f}"
            cells.append(f"[bold]{text}[/bold]" if name == workload["best_manual"] else text)
        match = (
            "all match"
            if workload["tokens_match_all"]
            else "MISMATCH: "
            + ", ".join(n for n, c in workload["contenders"].items() if not c["tokens_match"])
        )
        table.add_row(
            workload["key"], *cells, choice_text(workload), f"{workload['auto_over_best']:.3f}", match
        )
    return table
