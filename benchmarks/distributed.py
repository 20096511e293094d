"""RayRollout (2 workers, 1 thread each) vs one process, cost-balanced vs round-robin sharding.

    python benchmarks/distributed.py --repeats 5 --out results/distributed.json

Model: `bench-qwen2` (20.3M params, random weights, fp32, CPU). Workload: 128 prompts from the
reference's long-tail ratio (8 x 512 + 120 x 16 tokens, shuffled with --seeds), 16 new tokens, route
"auto" with the 2-core CPU coefficients of docs/benchmarks.md (or --costs). Contenders, interleaved after
one warm-up each: one process with 2 threads (the whole machine) and with 1 thread, and RayRollout
with cost and round-robin sharding (the same two actors, the strategy switched between calls).
Reported: medians, speed-ups, predicted and measured imbalance (max/mean over workers), Ray overhead
(call wall time - slowest worker), token agreement; raw samples to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
from pathlib import Path

import torch

from autobucket import CostCoefficients, RolloutConfig, SamplingConfig
from autobucket.models import build_tiny_model
from autobucket.prompts import random_prompts
from autobucket.tools.workloads import rollout_contender, time_interleaved, tokens_agree

# Fit on this model, 2-core development machine (docs/benchmarks.md): ms ~ 5.8 + 0.0537·B·L + 4.1e-5·B·L².
CPU_COSTS = CostCoefficients(fixed_ms=5.8, token_ms=0.0537, attention_ms=10.0)


def long_tail_lengths(count: int, seed: int) -> list[int]:
    lengths = [512] * (count // 16) + [16] * (count - count // 16)
    random.Random(seed).shuffle(lengths)
    return lengths


def single_contender(model, config: RolloutConfig, sampling: SamplingConfig, threads: int):
    run_route = rollout_contender(model, config.route, sampling, config.costs)

    def run(prompts):
        torch.set_num_threads(threads)  # the contenders differ only in threads: set before each run
        return run_route(prompts)

    return run


def ray_contender(rr, sharding: str, sampling: SamplingConfig, log: list[dict]):
    def run(prompts):
        rr.sharding = sharding
        result = rr.generate(prompts, sampling)
        log.append({
            "predicted_imbalance": result.predicted_imbalance, "measured_imbalance": result.measured_imbalance,
            "overhead_ms": result.profile.total_ms - max(w.measured_ms for w in result.workers),
            "workers": [{"prompts": w.prompts, "predicted_ms": w.predicted_ms, "measured_ms": w.measured_ms,
                         "route": w.route} for w in result.workers],
        })
        return result.tokens, result.profile.to_dict()

    return run


def with_load_log(contenders: dict, load_log: dict[str, list[float]]) -> dict:
    """Record the 1-minute load average before every call: the machine is shared."""

    def logged(name, contender):
        def run(prompts):
            load_log[name].append(os.getloadavg()[0])
            return contender(prompts)

        return run

    return {name: logged(name, contender) for name, contender in contenders.items()}


def workload_rows(seed: int, contenders: dict, logs: dict[str, list[dict]], args) -> list[dict]:
    prompts = random_prompts(long_tail_lengths(args.prompts, seed), 32000, seed=seed)
    for log in logs.values():
        log.clear()
    load_log: dict[str, list[float]] = {name: [] for name in contenders}
    runs = time_interleaved(with_load_log(contenders, load_log), prompts, args.repeats)
    agree = tokens_agree(runs, "single_2t")
    rows = []
    for name, run in runs.items():
        timed = logs.get(name, [])[1:]  # the first entry is the warm-up
        row = {
            "seed": seed, "contender": name, "median_ms": run.median_ms, "samples_ms": run.samples_ms,
            "speedup_vs_single_2t": runs["single_2t"].median_ms / run.median_ms,
            "speedup_vs_single_1t": runs["single_1t"].median_ms / run.median_ms,
            "tokens_match_single": agree[name], "runs": timed,
            "loadavg_1min": load_log[name][1:],  # at the start of each timed sample (other users' load)
        }
        for key in ("predicted_imbalance", "measured_imbalance", "overhead_ms"):
            row[key] = statistics.median(entry[key] for entry in timed) if timed else None
        rows.append(row)
        imbalance = f"pred {row['predicted_imbalance']:.3f} meas {row['measured_imbalance']:.3f}" if timed else ""
        print(f"seed {seed} {name:16s} {run.median_ms:8.1f} ms  x{row['speedup_vs_single_2t']:.2f} vs 2 threads  "
              f"x{row['speedup_vs_single_1t']:.2f} vs 1 thread  {imbalance}  match={agree[name]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--costs", help="costs JSON (default: the 2-core CPU fit of docs/benchmarks.md)")
    parser.add_argument("--out", default="results/distributed.json")
    args = parser.parse_args()
    import ray

    from autobucket.distributed.ray_rollout import RayRollout

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = RolloutConfig(route="auto", costs=args.costs or CPU_COSTS)
    sampling = SamplingConfig(max_new_tokens=16)
    model = build_tiny_model("bench-qwen2")
    logs: dict[str, list[dict]] = {"ray_cost": [], "ray_round_robin": []}
    rows = []
    with RayRollout("bench-qwen2", num_workers=2, config=config, torch_threads=1) as rr:
        contenders = {
            "single_2t": single_contender(model, config, sampling, threads=2),
            "single_1t": single_contender(model, config, sampling, threads=1),
            "ray_cost": ray_contender(rr, "cost", sampling, logs["ray_cost"]),
            "ray_round_robin": ray_contender(rr, "round_robin", sampling, logs["ray_round_robin"]),
        }
        for seed in args.seeds:
            rows += workload_rows(seed, contenders, logs, args)
    report = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "ray": ray.__version__, "python": platform.python_version()},
        "costs": config.costs.to_dict() if isinstance(config.costs, CostCoefficients) else config.costs,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
