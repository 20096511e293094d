"""What the engine reads of the trainer's model at each call, timed: the prefix cache's key (parameters,
buffers, adapters, forward hooks), the compiled step's hook set, and the model fingerprint the learned
costs follow.

    quiet-run -- python benchmarks/studies/per_call_reads.py --out results/per_call_reads.json
    # smoke: --model tiny-llama --calls 50 --out /tmp/reads.json

One process, one thread, `--model` (SmolLM2-135M by default: 397 modules); each read is timed `--calls`
times after one warm-up call, the reads interleaved call by call so drift hits all alike. Medians in µs
and the raw samples to JSON. A read runs where its feature is on: the key with `prefix_cache_mb > 0`,
the hook set with `compile`, the fingerprint at every call."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from autobucket import Rollout, RolloutConfig
from autobucket.costs.calibration_file import host_cpu
from autobucket.engine.compiled.compiled_decode import hooks_epoch
from autobucket.engine.model_access.weight_versions import adapter_state, forward_state, weights_version
from autobucket.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default="results/per_call_reads.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, _ = load_model(args.model)
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    reads = {
        "weights_version (the prefix cache's key)": lambda: weights_version(model, "sdpa", "torch"),
        "forward_state (hooks, replaced forwards)": lambda: forward_state(model),
        "adapter_state (peft tuner layers)": lambda: adapter_state(model),
        "hooks_epoch (compile on)": lambda: hooks_epoch(model),
        "Rollout._follow_model (every call)": rollout._follow_model,
    }
    samples_us: dict[str, list[float]] = {name: [] for name in reads}
    for read in reads.values():
        read()  # warm-up
    for _ in range(args.calls):
        for name, read in reads.items():
            started = time.perf_counter()
            read()
            samples_us[name].append((time.perf_counter() - started) * 1e6)
    medians = {name: statistics.median(values) for name, values in samples_us.items()}
    modules = sum(1 for _ in model.modules())
    print(f"{args.model} ({modules} modules), {args.calls} calls each, medians:")
    for name, value in medians.items():
        print(f"| {name} | {value:,.1f} µs |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    record = {"cpu": host_cpu(), "torch": torch.__version__, "args": vars(args), "modules": modules,
              "medians_us": medians, "samples_us": samples_us}  # fmt: skip
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
