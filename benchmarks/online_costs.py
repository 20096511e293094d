"""Online cost learning from a fresh cache vs an offline calibration.

    taskset -c 1 python benchmarks/online_costs.py --out results/online_costs.json \
        --plot docs/online_costs_learning.png

Model: the 20.3M-param random-weight Qwen2 (`bench-qwen2`), fp32, one torch thread. Steps:

1. **Offline calibration on this (busy) machine** within 60 s (`default_plan`, `max_seconds=60`): fitted
   and held-out median errors, or the refusal and how long it took. If it refuses, a second calibration
   with more time serves as the offline reference for step 4.
2. **Online, fresh cache** (a new `AUTOBUCKET_CACHE_DIR`): Auto with ``costs="online"`` on a stream of 5
   mixed-length batches (32 prompts, long-tailed lengths), the probe included; predicted / measured per call.
3. **The sweep's reference workloads** with ``costs="online"`` (Auto continues from the cache entry step 2
   left; manual routes on fixed coefficients), interleaved, medians: Auto / best manual per workload.
4. **Route choices**: the route the online Auto took on each workload vs `choose_route` with the offline
   coefficients.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch


def offline_calibration(model, max_seconds: float) -> dict:
    from autobucket.costs.calibration.measure import calibrate, default_plan, model_geometry

    plan = default_plan(model_geometry(model).max_positions, repeats=5)
    from dataclasses import replace

    started = time.perf_counter()
    result = calibrate(model, replace(plan, max_seconds=max_seconds))
    return {
        "seconds": time.perf_counter() - started, "ok": result.report.ok, "problems": result.report.problems,
        "rounds": result.measurements["rounds"], "fit_error": result.report.median_error(holdout=False),
        "holdout_error": result.report.median_error(holdout=True), "costs": result.costs.to_dict(),
    }  # fmt: skip


def mixed_stream(calls: int, vocab: int, seed: int) -> list[list[list[int]]]:
    """Batches of 32 long-tailed prompt lengths (most short, a few up to 512)."""
    from autobucket.prompts import random_prompts

    rng = random.Random(seed)
    batches = []
    for call in range(calls):
        lengths = [min(512, max(1, int(rng.paretovariate(1.2) * 12))) for _ in range(32)]
        batches.append(random_prompts(lengths, vocab, seed=seed + call))
    return batches


def online_stream(model, calls: int) -> list[dict]:
    from autobucket import Rollout, RolloutConfig, SamplingConfig
    from autobucket.tools.sweep import learning_point

    rollout = Rollout(model, config=RolloutConfig(route="auto"))
    sampling = SamplingConfig(max_new_tokens=16, continuous_batch_size=32)
    points = []
    vocab = int(model.get_output_embeddings().weight.shape[0])
    for index, prompts in enumerate(mixed_stream(calls, vocab, seed=100)):
        started = time.perf_counter()
        profile = rollout.generate(prompts, sampling).profile
        points.append({**learning_point(profile.to_dict(), index), "call_s": time.perf_counter() - started})
        print(f"stream call {index + 1}: {profile.route} source={profile.costs_source} "
              f"predicted {profile.predicted_ms:.0f} ms / measured {profile.measured_ms:.0f} ms", flush=True)  # fmt: skip
    return points


# The quiet-machine calibration of docs/benchmarks.md ("Calibration": held-out median error 8.7%).
DOCUMENTED_QUIET = {"fixed_ms": 5.741, "token_ms": 0.1037, "attention_ms": 12.70, "kv_ms": 0.1182, "decode_ms": 0.0,
                    "ordinary_decode_ms": 0.3191, "ordinary_decode_kv_ms": 0.0357}  # fmt: skip


def route_choices(report: dict, offline_costs: dict, model) -> list[dict]:
    from autobucket.costs.calibration.measure import model_geometry
    from autobucket.costs.coefficients import CostCoefficients
    from autobucket.planning.route_choice import choose_route

    geometry = model_geometry(model)
    references = {"offline": CostCoefficients.from_dict(offline_costs),
                  "documented_quiet": CostCoefficients.from_dict(DOCUMENTED_QUIET)}  # fmt: skip
    rows = []
    for workload in report["workloads"]:
        row = {"workload": workload["key"], "online": workload["auto"]["route"],
               "auto_over_best": workload["auto_over_best"], "best_manual": workload["best_manual"]}  # fmt: skip
        for name, costs in references.items():
            row[name] = choose_route(workload["lengths"], 16, 32, geometry, costs, max_positions=geometry.max_positions).route
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/online_costs.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/online_costs_learning.png"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stream-calls", type=int, default=5)
    parser.add_argument("--model", default="bench-qwen2", help="a tiny config name (tiny-qwen2: a smoke run)")
    parser.add_argument("--fallback-seconds", type=float, default=300.0,
                        help="budget of the reference calibration when the 60 s one refuses")  # fmt: skip
    args = parser.parse_args()
    os.environ["AUTOBUCKET_CACHE_DIR"] = tempfile.mkdtemp(prefix="autobucket-online-")  # a fresh cache
    torch.set_num_threads(1)
    from autobucket.models import build_tiny_model
    from autobucket.tools.learning_curve import plot_learning_curve
    from autobucket.tools.sweep import SweepOptions, run_sweep
    from autobucket.tools.workloads import reference_workloads

    model = build_tiny_model(args.model)
    calibration = offline_calibration(model, 60.0)
    print("offline calibration (60 s budget):", {k: v for k, v in calibration.items() if k != "costs"}, flush=True)
    reference = calibration if calibration["ok"] else offline_calibration(model, args.fallback_seconds)
    print("reference calibration:", {k: v for k, v in reference.items() if k != "costs"}, flush=True)
    stream = online_stream(model, args.stream_calls)
    options = SweepOptions(repeats=args.repeats, with_hf_batch=False)
    report = run_sweep(model, "online", reference_workloads(), options)
    choices = route_choices(report, reference["costs"], model)
    for row in choices:
        print(row, flush=True)
    curve = stream + [{**p, "call": p["call"] + len(stream)} for p in report["learning_curve"]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"calibration_60s": calibration, "reference_calibration": reference,
                                    "stream": stream, "sweep": report, "route_choices": choices,
                                    "learning_curve": curve}, indent=1) + "\n")  # fmt: skip
    plot_learning_curve(curve, str(args.plot), f"{args.model}, fresh cache: {len(stream)} mixed-length calls, then the sweep")
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
