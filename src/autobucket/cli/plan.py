"""``autobucket plan``: the prefill groups (padded, packed or chunked) and route the planner picks for
some prompt lengths (no torch)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rich.console import Console
from rich.table import Table

from autobucket.cli.args import add_alias, finish_parser, parse_lengths, positive_int
from autobucket.costs.coefficients import (
    BENCH_QWEN2_GEOMETRY,
    CostCoefficients,
    ModelGeometry,
    load_costs,
    prefill_cost_ms,
)
from autobucket.planning.forms import (
    CHUNKED,
    DENSE,
    PACKED,
    SEGMENTS,
    FormCosts,
    chunked_cost_ms,
    packed_cost_ms,
)
from autobucket.planning.planner import DEFAULT_PREFILL_MAX_TOKENS
from autobucket.planning.route_choice import FormOptions, RouteDecision, choose_route

_GEOMETRY_FLAGS = ("layers", "query_heads", "kv_heads", "head_dim", "element_bytes", "max_positions")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show the prefill buckets and route the planner picks for some prompt lengths",
        description="Estimate ordinary padded generate vs bucketed continuous batching for a batch.",
    )
    parser.add_argument(
        "--lengths",
        required=True,
        type=parse_lengths,
        help="prompt lengths in tokens: L or LxN (N prompts of L), comma-separated, e.g. 512,16x31",
    )
    parser.add_argument("--costs", type=Path, help="cost coefficients JSON (default: built-in estimates)")
    parser.add_argument("--model-config", type=Path, help="an HF config.json to read the geometry from")
    for flag in _GEOMETRY_FLAGS:
        parser.add_argument(
            f"--{flag.replace('_', '-')}",
            type=positive_int,
            metavar="N",
            help="override this field of the geometry (from --model-config, else the "
            "20.3M-parameter benchmark Qwen2)",
        )
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
        help="most rows decoded at once (default: 32)",
    )
    add_alias(parser, "--capacity", "--continuous-batch-size", "continuous_batch_size", type=positive_int)
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--prefill-max-tokens", type=positive_int, default=DEFAULT_PREFILL_MAX_TOKENS, metavar="N",
                       help=f"token budget of one prefill forward, padding included; longer prompts are chunked "
                            f"(default: {DEFAULT_PREFILL_MAX_TOKENS})")
    limit.add_argument(
        "--no-prefill-limit",
        dest="prefill_max_tokens",
        action="store_const",
        const=None,
        help="no limit on the tokens of one prefill forward",
    )
    add_alias(limit, "--max-tokens", "--prefill-max-tokens", "prefill_max_tokens", type=positive_int)
    add_alias(limit, "--no-token-limit", "--no-prefill-limit", "prefill_max_tokens", nargs=0, const=None)
    parser.add_argument(
        "--packing",
        choices=(SEGMENTS, DENSE, "none"),
        default=SEGMENTS,
        help="how packed prompts are kept apart: per-prompt SDPA (sdpa models, the default), a dense "
        "block mask (eager models), or none (padded buckets only)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    finish_parser(parser, _run_plan, phrases={"pass None for no limit": "pass --no-prefill-limit"})


def _run_plan(args: argparse.Namespace) -> int:
    geometry = _geometry_from_args(args)
    _check_context(args.lengths, args.max_new_tokens, geometry.max_positions)
    costs = CostCoefficients() if args.costs is None else load_costs(args.costs)
    decision = choose_route(
        args.lengths,
        max_new_tokens=args.max_new_tokens,
        continuous_batch_size=args.continuous_batch_size,
        geometry=geometry,
        costs=costs,
        prefill_max_tokens=args.prefill_max_tokens,
        max_positions=geometry.max_positions,
        forms=FormOptions(None if args.packing == "none" else args.packing),
    )
    if args.json:
        print(json.dumps(_plan_json(args, decision, geometry, costs)))
    else:
        _print_plan(decision, geometry, costs, args)
    return 0


def _check_context(lengths: list[int], max_new_tokens: int, max_positions: int | None) -> None:
    """The engine refuses a prompt whose length plus budget passes the model's positions
    (`prompts.check_context`), so a plan for it would plan a call that cannot run."""
    if max_positions is None:
        return
    for index, length in enumerate(lengths):
        if length + max_new_tokens > max_positions:
            raise ValueError(
                f"--lengths: prompt {index} has {length} tokens; with --max-new-tokens {max_new_tokens} it needs "
                f"{length + max_new_tokens} positions, over max_positions {max_positions}: shorten it, lower "
                "--max-new-tokens, or give the model's own context (--max-positions or --model-config)"
            )


def _geometry_from_args(args: argparse.Namespace) -> ModelGeometry:
    base = BENCH_QWEN2_GEOMETRY if args.model_config is None else _read_model_config(args.model_config)
    overrides = {flag: getattr(args, flag) for flag in _GEOMETRY_FLAGS if getattr(args, flag) is not None}
    return replace(base, **overrides)


def _read_model_config(path: Path) -> ModelGeometry:
    try:
        config = json.loads(path.read_text(encoding="utf-8"), object_hook=lambda d: SimpleNamespace(**d))
    except OSError as exc:
        raise ValueError(f"cannot read model config {str(path)!r}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"model config {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(config, SimpleNamespace):
        raise ValueError(f"model config {str(path)!r} must hold a JSON object (an HF config.json)")
    # transformers 5 writes "dtype", 4.x "torch_dtype"; HF configs default to float32 weights.
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    try:
        return ModelGeometry.from_config(config, dtype)
    except ValueError as exc:
        raise ValueError(f"model config {str(path)!r}: {exc}") from exc


def _plan_json(
    args: argparse.Namespace, decision: RouteDecision, geometry: ModelGeometry, costs: CostCoefficients
) -> dict[str, Any]:
    return {
        "route": decision.route,
        "reason": decision.reason,
        "buckets": [list(bucket) for bucket in decision.buckets],
        "widths": list(decision.widths),
        "forms": list(decision.forms),
        "ordinary_ms": decision.ordinary_ms,
        "bucketed_ms": decision.bucketed_ms,
        "bucketed_lower_bound_ms": decision.bucketed_lower_bound_ms,
        "prompts": len(args.lengths),
        "max_new_tokens": args.max_new_tokens,
        "continuous_batch_size": args.continuous_batch_size,
        "prefill_max_tokens": args.prefill_max_tokens,
        "costs": costs.to_dict(),
        "geometry": asdict(geometry),
    }


def _print_plan(
    decision: RouteDecision, geometry: ModelGeometry, costs: CostCoefficients, args: argparse.Namespace
) -> None:
    console = Console()
    if decision.buckets:
        console.print(_bucket_table(decision, geometry, costs, args))
    else:
        console.print("No prefill buckets: the DP was skipped (or there are no prompts).")
    console.print(_route_table(decision))
    console.print(f"geometry: {_fields_text(asdict(geometry))}", highlight=False, soft_wrap=True)
    console.print(f"costs: {_fields_text(costs.to_dict())}", highlight=False, soft_wrap=True)


def _bucket_table(
    decision: RouteDecision, geometry: ModelGeometry, costs: CostCoefficients, args: argparse.Namespace
) -> Table:
    table = Table(title="Prefill groups (bucketed route)")
    for column in ("group", "form", "prompts", "width", "tokens run", "est. prefill ms", "prompt indices"):
        table.add_column(column, justify="left" if column in ("form", "prompt indices") else "right")
    for number, (bucket, width, form) in enumerate(zip(decision.buckets, decision.widths, decision.forms, strict=True)):
        lengths = [args.lengths[i] for i in bucket]
        if form == CHUNKED:
            tokens, prefill_ms = lengths[0], chunked_cost_ms(lengths[0], args.prefill_max_tokens, geometry, costs)
            form = f"chunked:{-(-lengths[0] // args.prefill_max_tokens)}"  # forwards
        elif form == PACKED:
            tokens = sum(lengths)
            prefill_ms = packed_cost_ms(lengths, geometry, costs, FormCosts.of(costs), args.packing)
        else:
            tokens, prefill_ms = len(bucket) * width, prefill_cost_ms(len(bucket), width, geometry, costs)
        table.add_row(
            str(number), form, str(len(bucket)), str(width), str(tokens), f"{prefill_ms:.1f}", _index_ranges(bucket)
        )
    return table


def _route_table(decision: RouteDecision) -> Table:
    table = Table(title="Route", show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="left")
    ordinary = "ineligible" if decision.ordinary_ms is None else f"{decision.ordinary_ms:.1f} ms"
    if decision.bucketed_ms is None:
        bucketed = f"DP skipped (lower bound {decision.bucketed_lower_bound_ms:.1f} ms)"
    else:
        bucketed = f"{decision.bucketed_ms:.1f} ms (prefill buckets + CB decode term)"
    table.add_row("ordinary estimate", ordinary)
    table.add_row("bucketed estimate", bucketed)
    table.add_row("chosen route", f"[bold]{decision.route}[/bold]")
    table.add_row("reason", decision.reason)
    return table


def _index_ranges(indices: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2, 5"``: a bucket's prompts are often runs of consecutive indices."""
    runs: list[list[int]] = []
    for index in sorted(indices):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _fields_text(values: dict[str, Any]) -> str:
    return " ".join(f"{name}={value}" for name, value in values.items())

