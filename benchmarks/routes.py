"""Every route on the five prefill-bucketing workloads (32 prompts, 16 new tokens), plus decode speed.

    python benchmarks/routes.py --repeats 3 --out results/routes.json

Model: the 20.3M-param random-weight Qwen2 `bench-qwen2` (docs/benchmarks.md), fp32, CPU.
Contenders: ordinary (HF generate), equal_width, aligned, auto (when --costs is given or fitted
with --fit), and HF `generate_batch` (transformers 5.x). One warm-up, then interleaved repeats;
medians, ratios, token agreement; raw samples to JSON.

Decode section: uniform prompts of 512 tokens, 64 new tokens, B = 8 and 32; per-step decode time
= (call time - prefill time) / decode steps, for HF generate and for the CB decode loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.models import build_tiny_model
from autobucket.prompts import random_prompts
from autobucket.tools.baselines import has_generate_batch, hf_batch_contender
from autobucket.tools.workloads import reference_workloads, rollout_contender, time_interleaved, tokens_agree


def contenders_for(model, sampling: SamplingConfig, costs, with_hf_batch: bool):
    contenders = {route: rollout_contender(model, route, sampling) for route in ("ordinary", "equal_width", "aligned")}
    if costs is not None:
        contenders["auto"] = rollout_contender(model, "auto", sampling, costs)
    if with_hf_batch and has_generate_batch(model):
        contenders["hf_generate_batch"] = hf_batch_contender(model, sampling.max_new_tokens)
    return contenders


def route_table(model, args, costs) -> list[dict]:
    sampling = SamplingConfig(max_new_tokens=16, continuous_batch_size=32)
    rows = []
    for workload in reference_workloads():
        prompts = random_prompts(workload.lengths, model.config.vocab_size, seed=args.seed)
        runs = time_interleaved(contenders_for(model, sampling, costs, not args.no_hf_batch), prompts, args.repeats)
        agree = tokens_agree(runs, "ordinary")
        best_manual = min(runs[n].median_ms for n in ("ordinary", "equal_width", "aligned"))
        for name, run in runs.items():
            profile = run.profile or {}
            rows.append({
                "workload": workload.name, "contender": name, "median_ms": run.median_ms, "mean_ms": run.mean_ms,
                "samples_ms": run.samples_ms, "tokens_match_ordinary": agree[name],
                "tok_per_s": sum(len(t) for t in run.tokens) / (run.median_ms / 1e3),
                "ratio_to_best_manual": run.median_ms / best_manual,
                "peak_memory_mib": profile.get("peak_memory_bytes", 0) / 2**20,
                "prefill_forwards": profile.get("prefill_forwards"), "decode_forwards": profile.get("decode_forwards"),
                "route": profile.get("route"), "prefill_groups": profile.get("prefill_groups"),
                "prefill_ms": profile.get("prefill_ms"), "decode_ms": profile.get("decode_ms"),
                "cache_ms": profile.get("cache_ms"), "plan_ms": profile.get("plan_ms"),
            })
            print(f"{workload.name:32s} {name:18s} {run.median_ms:9.1f} ms  x{run.median_ms / best_manual:5.2f} "
                  f"of best manual  match={agree[name]}  forwards={profile.get('prefill_forwards')}/"
                  f"{profile.get('decode_forwards')}", flush=True)
    return rows


def decode_table(model, args) -> list[dict]:
    """Per-step decode: HF generate (ordinary) vs the CB loop (equal_width), same B and cache length."""
    rows = []
    for batch in (8, 32):
        prompts = random_prompts([512] * batch, model.config.vocab_size, seed=args.seed)
        sampling = SamplingConfig(max_new_tokens=64, continuous_batch_size=batch)
        routes = {route: Rollout(model, config=RolloutConfig(route=route)) for route in ("ordinary", "equal_width")}
        steps = {route: [] for route in routes}
        for repeat in range(args.repeats + 1):
            for route, rollout in routes.items():
                started = time.perf_counter()
                result = rollout.generate(prompts, sampling)
                call_ms = (time.perf_counter() - started) * 1e3
                if repeat:  # the first round is warm-up
                    profile = result.profile
                    steps[route].append((call_ms - profile.prefill_ms) / profile.decode_forwards)
        hf, cb = statistics.median(steps["ordinary"]), statistics.median(steps["equal_width"])
        rows.append({"batch": batch, "prompt": 512, "new_tokens": 64, "hf_generate_step_ms": hf, "cb_step_ms": cb,
                     "ratio": cb / hf, "samples": steps})
        print(f"decode B={batch:2d}: HF generate {hf:6.2f} ms/step, CB {cb:6.2f} ms/step, ratio {cb / hf:.3f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--costs", help="costs JSON for the auto contender")
    parser.add_argument("--fit", action="store_true", help="fit coefficients for auto first (autobucket.costs.calibration.measure)")
    parser.add_argument("--no-hf-batch", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-routes", action="store_true", help="only the decode-step section")
    parser.add_argument("--threads", type=int, help="torch threads (match the calibration's)")
    parser.add_argument("--out", default="results/routes.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_tiny_model("bench-qwen2")
    costs = args.costs
    if args.fit:
        from autobucket.costs.calibration.measure import quick_fit

        costs = quick_fit(model)
        print("fitted:", costs.to_dict())
    report = {"machine": {"threads": torch.get_num_threads(), "torch": torch.__version__}}
    if not args.skip_routes:
        report["routes"] = route_table(model, args, costs)
    if not args.skip_decode:
        report["decode"] = decode_table(model, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
