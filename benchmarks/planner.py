"""Planner overhead: `plan_prefill` (linear deque DP) vs a plain O(n²) double-loop DP, `choose_route`, and
the forms planner (`plan_forms`: padded / packed / chunked) beside `plan_prefill`.

    python benchmarks/planner.py --repeats 10 --out results/planner.json

Lengths are uniform on 1..512 or 1..65,536 (fixed seed), with the default 65,536-token limit and with no
limit. Both DPs run interleaved on the same inputs after a warm-up, must agree on the cost, and the script
prints a Markdown table of medians (p10/p90 in the JSON with every raw sample).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autobucket.costs.coefficients import (
    BENCH_QWEN2_GEOMETRY,
    CostCoefficients,
    ModelGeometry,
    prefill_cost_ms,
    prefill_row_terms_ms,
)
from autobucket.planning.forms import DENSE, SEGMENTS, plan_forms
from autobucket.planning.planner import plan_prefill
from autobucket.planning.route_choice import choose_route

SIZES = (32, 128, 256, 1024)
MAX_LENGTHS = (512, 65536)
REFERENCE_SIZES = (128, 256)  # the DeepSpeed prefill-bucketing PR timed this many prompts of 65,536 tokens
LIMITS = (65536, None)
WARMUP_RUNS = 3


def quadratic_dp_cost_ms(
    lengths: list[int], geometry: ModelGeometry, costs: CostCoefficients, max_tokens: int | None
) -> float:
    """Reference-style baseline: for every end, scan every start; over-limit segments skip evaluation."""
    ordered = sorted(lengths, reverse=True)
    linear_ms, quadratic_ms = prefill_row_terms_ms(geometry, costs)
    row_ms = [linear_ms * width + quadratic_ms * width * width for width in ordered]
    n = len(ordered)
    best = [0.0] + [math.inf] * n
    parent = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):
            rows = end - start
            if max_tokens is not None and rows * ordered[start] > max_tokens:
                continue
            cost = best[start] + costs.fixed_ms + row_ms[start] * rows
            if cost < best[end]:
                best[end], parent[end] = cost, start
    return _unwound_cost_ms(ordered, parent, geometry, costs)


def _unwound_cost_ms(
    ordered: list[int], parent: list[int], geometry: ModelGeometry, costs: CostCoefficients
) -> float:
    total_ms, end = 0.0, len(ordered)
    while end > 0:
        start = parent[end]
        total_ms += prefill_cost_ms(end - start, ordered[start], geometry, costs)
        end = start
    return total_ms


def time_ms(function: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter_ns()
    result = function()
    return (time.perf_counter_ns() - start) / 1e6, result


def summary(samples: list[float]) -> dict[str, float]:
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return {"median_ms": statistics.median(samples), "p10_ms": deciles[0], "p90_ms": deciles[-1]}


def bench_plan_case(
    n: int, max_length: int, max_tokens: int | None, repeats: int, seed: int, uniform: bool = False
) -> dict[str, Any]:
    rng = random.Random(f"{seed}-{n}-{max_length}")
    lengths = [max_length] * n if uniform else [rng.randint(1, max_length) for _ in range(n)]
    geometry, costs = BENCH_QWEN2_GEOMETRY, CostCoefficients()

    def ours() -> float:
        return plan_prefill(lengths, geometry, costs, max_tokens).cost_ms

    def baseline() -> float:
        return quadratic_dp_cost_ms(lengths, geometry, costs, max_tokens)

    for _ in range(WARMUP_RUNS):
        ours(), baseline()
    samples: dict[str, list[float]] = {"ours": [], "baseline": []}
    for repeat in range(repeats):
        # Alternate which contender runs first so cache/turbo effects do not favour one.
        pair = [("ours", ours), ("baseline", baseline)][:: 1 if repeat % 2 == 0 else -1]
        results = {}
        for name, function in pair:
            elapsed_ms, results[name] = time_ms(function)
            samples[name].append(elapsed_ms)
        if not math.isclose(results["ours"], results["baseline"], rel_tol=1e-9):
            raise AssertionError(f"cost mismatch n={n} max_length={max_length}: {results}")
    buckets = len(plan_prefill(lengths, geometry, costs, max_tokens).buckets)
    return {
        "n": n,
        "max_length": max_length,
        "uniform": uniform,
        "max_tokens": max_tokens,
        "buckets": buckets,
        "samples_ms": samples,
        **{name: summary(values) for name, values in samples.items()},
    }


def bench_forms_case(n: int, max_tokens: int | None, repeats: int, seed: int) -> dict[str, Any]:
    """plan_prefill vs the forms planner (padded/packed/chunked) on the same lengths, interleaved."""
    rng = random.Random(f"{seed}-{n}-forms")
    lengths = [rng.randint(1, 512) for _ in range(n)]
    geometry, costs = BENCH_QWEN2_GEOMETRY, CostCoefficients()
    contenders = {
        "plan_prefill": lambda: plan_prefill(lengths, geometry, costs, max_tokens),
        "forms_segments": lambda: plan_forms(lengths, geometry, costs, max_tokens, packing=SEGMENTS),
        "forms_dense": lambda: plan_forms(lengths, geometry, costs, max_tokens, packing=DENSE),
    }
    for function in contenders.values():
        for _ in range(WARMUP_RUNS):
            function()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, function in contenders.items():
            samples[name].append(time_ms(function)[0])
    return {"n": n, "max_tokens": max_tokens, "samples_ms": samples, **{k: summary(v) for k, v in samples.items()}}


def forms_table(cases: list[dict[str, Any]]) -> str:
    lines = ["| n (1..512) | token limit | plan_prefill ms | forms, segments ms | forms, dense ms |", "|---:|---|---:|---:|---:|"]
    for case in cases:
        limit = "none" if case["max_tokens"] is None else f"{case['max_tokens']:,}"
        cells = " | ".join(f"{case[k]['median_ms']:.3f}" for k in ("plan_prefill", "forms_segments", "forms_dense"))
        lines.append(f"| {case['n']} | {limit} | {cells} |")
    return "\n".join(lines)


def bench_route_case(
    name: str, lengths: list[int], continuous_batch_size: int, prefill_max_tokens: int | None, repeats: int
) -> dict:
    decide = functools.partial(
        choose_route, lengths, 16, continuous_batch_size, BENCH_QWEN2_GEOMETRY, CostCoefficients(), prefill_max_tokens=prefill_max_tokens
    )
    for _ in range(WARMUP_RUNS):
        decide()
    samples, decisions = zip(*(time_ms(decide) for _ in range(repeats)), strict=True)
    decision = decisions[-1]
    return {
        "case": name,
        "n": len(lengths),
        "route": decision.route,
        "dp_skipped": decision.bucketed_ms is None,
        "samples_ms": list(samples),
        **summary(list(samples)),
    }


def route_cases(seed: int) -> list[tuple[str, list[int], int, int | None]]:
    rng = random.Random(f"{seed}-route")
    return [
        (
            "1024 mixed (<=512), continuous_batch_size 32: ordinary ineligible, DP runs",
            [rng.randint(1, 512) for _ in range(1024)],
            32,
            65536,
        ),
        (
            "1024 mixed (<=65536), continuous_batch_size 32: ordinary ineligible, DP runs",
            [rng.randint(1, 65536) for _ in range(1024)],
            32,
            65536,
        ),
        ("1024 x 16 tokens, continuous_batch_size 1024: lower bound skips the DP", [16] * 1024, 1024, None),
    ]


def markdown_tables(plans: list[dict[str, Any]], routes: list[dict[str, Any]]) -> str:
    lines = [
        "| n | lengths | token limit | buckets | plan_prefill median (p10-p90) ms | O(n²) DP median ms | "
        "O(n²) / ours |",
        "|---:|---|---|---:|---|---:|---:|",
    ]
    for case in plans:
        ours, base = case["ours"], case["baseline"]
        limit = "none" if case["max_tokens"] is None else f"{case['max_tokens']:,}"
        lengths = f"{'all ' if case['uniform'] else '1..'}{case['max_length']:,}"
        lines.append(
            f"| {case['n']} | {lengths} | {limit} | {case['buckets']} | "
            f"{ours['median_ms']:.3f} ({ours['p10_ms']:.3f}-{ours['p90_ms']:.3f}) | "
            f"{base['median_ms']:.3f} | {base['median_ms'] / ours['median_ms']:.1f}x |"
        )
    lines += ["", "| choose_route case | route | median (p10-p90) ms |", "|---|---|---|"]
    for case in routes:
        lines.append(
            f"| {case['case']} | {case['route']} | "
            f"{case['median_ms']:.3f} ({case['p10_ms']:.3f}-{case['p90_ms']:.3f}) |"
        )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per case (>= 10 for p10/p90)")
    parser.add_argument("--out", type=Path, default=Path("results/planner.json"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    plans = [
        bench_plan_case(n, max_length, limit, args.repeats, args.seed)
        for max_length in MAX_LENGTHS
        for n in SIZES
        for limit in LIMITS
    ]
    plans += [
        bench_plan_case(n, 65536, 65536, args.repeats, args.seed, uniform=True) for n in REFERENCE_SIZES
    ]
    routes = [bench_route_case(*case, args.repeats) for case in route_cases(args.seed)]
    forms = [bench_forms_case(n, limit, args.repeats, args.seed) for n in SIZES for limit in LIMITS]
    print(markdown_tables(plans, routes))
    print()
    print(forms_table(forms))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": machine(),
        "repeats": args.repeats,
        "seed": args.seed,
        "plan_prefill": plans,
        "choose_route": routes,
        "plan_forms": forms,
    }
    args.out.write_text(json.dumps(report, indent=1))
    print(f"raw samples: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
