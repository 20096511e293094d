"""``autobucket calibrate``: measure a model on this device, fit the cost coefficients, save them.

Torch, transformers and scipy are imported inside the handler only, so other commands stay fast.
Exit status: 0 saved, 1 fit refused (nothing saved), 2 usage error.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from autobucket.cli.args import (
    add_alias,
    add_model_arguments,
    finish_parser,
    load_model_from_args,
    non_negative_float,
    positive_int,
)
from autobucket.cli.console import progress_bar

_SHAPE_ITEM = re.compile(r"(\d+):(\d+)", re.ASCII)
_FIT_REFUSED = 1


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure prefill/decode on this model and device and save fitted cost coefficients",
        description="Measure prefill shapes and the CB-vs-generate decode step, fit the cost model by "
        "non-negative least squares, print the fit report, and save it unless the fit is degenerate.",
    )
    add_model_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("costs.json"), help="calibration JSON to write")
    _add_shape_arguments(parser)
    parser.add_argument(
        "--decode-new-tokens",
        type=positive_int,
        default=16,
        help="new tokens per decode measurement; use the budget your workload uses",
    )
    parser.add_argument(
        "--max-length",
        type=positive_int,
        help="longest prompt of the default grids (default: min(512, model context))",
    )
    parser.add_argument("--repeats", type=positive_int, help="timed runs per shape (median; default 5, --quick 3)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small grid (at most 512 tokens per forward, short decode calls) that fits in a minute",
    )
    parser.add_argument(
        "--max-seconds",
        type=non_negative_float,
        default=60.0,
        metavar="S",
        help="stop measuring by S seconds (default 60); shapes left unmeasured are named",
    )
    parser.add_argument(
        "--max-median-error",
        type=non_negative_float,
        default=0.5,
        metavar="FRACTION",
        help="refuse the fit when the median relative error of the fitted prefill shapes "
        "exceeds this (default 0.5)",
    )
    add_alias(parser, "--max-error", "--max-median-error", "max_median_error", type=non_negative_float)
    parser.add_argument(
        "--max-holdout-error",
        type=non_negative_float,
        default=0.2,
        metavar="FRACTION",
        help="refuse the fit when the median relative error of the held-out shapes exceeds "
        "this (default 0.2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the measured prompts' random token ids (default 0)")
    finish_parser(parser, _run_calibrate)


def _add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    shapes = {"type": parse_shapes, "metavar": "B:L,..."}
    parser.add_argument(
        "--prefill-shapes", **shapes, help="prefill shapes to fit (default: B in 1..32, L up to --max-length)"
    )
    add_alias(parser, "--shapes", "--prefill-shapes", "prefill_shapes", type=parse_shapes)
    holdout = parser.add_mutually_exclusive_group()
    holdout.add_argument(
        "--holdout-shapes",
        **shapes,
        help="shapes measured but not fitted, to report held-out "
        "error (default: a grid between the fitted shapes)",
    )
    holdout.add_argument("--no-holdout", action="store_true", help="measure no held-out shapes")
    parser.add_argument(
        "--decode-shapes",
        **shapes,
        help="uniform batches for the CB-vs-generate decode step (default: 5 shapes)",
    )
    parser.add_argument(
        "--packed-shapes",
        **shapes,
        help="B prompts of L tokens packed in one row, to fit "
        "packed_prompt_ms (default: the prefill shapes with B >= 2 and B·L <= 2048)",
    )


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1:16,32:512"`` -> [(1, 16), (32, 512)] as (rows, tokens)."""
    shapes = []
    for item in text.split(","):
        match = _SHAPE_ITEM.fullmatch(item.strip())
        if match is None or int(match[1]) < 1 or int(match[2]) < 1:
            raise argparse.ArgumentTypeError(
                f"bad shape {item.strip()!r}: expected B:L with positive integers (rows:tokens), e.g. 1:16,32:512"
            )
        shapes.append((int(match[1]), int(match[2])))
    return shapes


def _run_calibrate(args: argparse.Namespace) -> int:
    from autobucket.costs.calibration.measure import calibrate, model_geometry
    from autobucket.costs.calibration_file import save_calibration

    model, _ = load_model_from_args(args)
    plan = _plan_from_args(args, model_geometry(model).max_positions)
    with progress_bar(plan.items, "measuring") as step:
        result = calibrate(
            model,
            plan,
            args.model,
            progress=step,
            max_median_error=args.max_median_error,
            max_holdout_error=args.max_holdout_error,
        )
    console = Console()
    console.print(fit_table(result.report.rows))
    console.print(coefficients_table(result.costs.to_dict()))
    _print_errors(console, result.report)
    if not result.report.ok:
        problems = "\n  ".join(result.report.problems)
        print(f"autobucket calibrate: fit refused, nothing saved:\n  {problems}", file=sys.stderr)
        return _FIT_REFUSED
    save_calibration(
        args.out,
        result.costs,
        result.metadata,
        result.measurements,
        extra={"plan": plan.to_dict(), "fit": result.report.to_dict()},
    )
    console.print(f"saved {args.out}")
    _seed_online_costs(model, result.costs, console)
    return 0


def _seed_online_costs(model: Any, costs: Any, console: Console) -> None:
    """A successful calibration also becomes this machine's prior for online learning (costs="online")."""
    from autobucket.costs.store import save_entry, store_metadata

    try:
        path = save_entry(store_metadata(model), costs, [], "file")
    except OSError as exc:
        console.print(f"(could not seed the online cost cache: {exc})")
        return
    console.print(f"online cost learning starts from it too ({path})", highlight=False)


def _plan_from_args(args: argparse.Namespace, max_positions: int | None):
    from dataclasses import replace

    from autobucket.costs.calibration.measure import Shape, default_plan, packed_shapes_for, quick_plan

    if args.max_seconds <= 0:
        raise ValueError(f"--max-seconds {args.max_seconds} is invalid: give a positive number of seconds")
    if args.quick:
        plan = quick_plan(max_positions, args.repeats or 3)
    else:
        plan = default_plan(max_positions, args.max_length, args.repeats or 5, args.decode_new_tokens)
    overrides: dict[str, Any] = {"seed": args.seed, "max_seconds": args.max_seconds}
    if not args.quick or args.decode_new_tokens != 16:  # --quick uses short decode calls unless told
        overrides["decode_new_tokens"] = args.decode_new_tokens
    for field, value in (("prefill_shapes", args.prefill_shapes), ("holdout_shapes", args.holdout_shapes),
                         ("decode_shapes", args.decode_shapes), ("packed_shapes", args.packed_shapes)):  # fmt: skip
        if value is not None:
            overrides[field] = tuple(Shape(rows, width) for rows, width in value)
    if args.prefill_shapes is not None and args.packed_shapes is None:
        overrides["packed_shapes"] = packed_shapes_for(overrides["prefill_shapes"])
    if args.no_holdout:
        overrides["holdout_shapes"] = ()
    return replace(plan, **overrides)


def fit_table(rows: list[Any]) -> Table:
    table = Table(
        title="Fit report (decode: CB − generate ms per step; its error is relative to a generate step)"
    )
    for column in ("kind", "B", "L", "set", "measured ms", "predicted ms", "error"):
        table.add_column(column, justify="left" if column in ("kind", "set") else "right")
    for row in rows:
        table.add_row(
            row.kind,
            str(row.rows),
            str(row.width),
            "held out" if row.holdout else "fit",
            f"{row.measured_ms:.2f}",
            f"{row.predicted_ms:.2f}",
            f"{row.relative_error:+.1%}",
        )
    return table


def coefficients_table(values: dict[str, float]) -> Table:
    table = Table(title="Fitted coefficients")
    table.add_column("coefficient")
    table.add_column("value", justify="right")
    for name, value in values.items():
        table.add_row(name, f"{value:.6g}")
    return table


def _print_errors(console: Console, report: Any) -> None:
    for label, holdout, kinds in (("fitted prefill shapes", False, ("prefill", "prefill+kv")),
                                  ("held-out prefill shapes", True, ("prefill", "prefill+kv")),
                                  ("decode shapes", False, ("decode",))):  # fmt: skip
        median = report.median_error(holdout, kinds)
        if median is not None:
            console.print(f"median |relative error|, {label}: {median:.1%}")
