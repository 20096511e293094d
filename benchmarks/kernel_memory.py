"""Peak memory of a rollout on the default kernels vs `kernels="invariant"`.

    quiet-run -- taskset -c 0 python benchmarks/kernel_memory.py --out results/kernel_memory.json

Each (model, dtype, kernels) runs in its own fresh process, so its peak RSS (VmHWM) is that contender's
alone: load the model, one warm-up call, reset the RSS peak, one measured call. The invariant kernels
hold one packed copy of every linear weight across calls (`Profile.packed_weight_bytes`: fp32 packs, and
bf16 packs where the bf16 GEMM's row blocks are used, fp32 ones where they are not); that copy is the
bound on what they add, and `packed_weights_mb` bounds it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# half: packed_weights_mb = half the parameters' size; none: 0 (no copies: the fp32 linears read the
# weights themselves on the unpacked fixed-order kernel)
CONTENDERS = ("torch", "invariant", "invariant-half", "invariant-none")


def measure_one(model_name: str, dtype_name: str, kernels: str) -> dict:
    import torch

    from autobucket import Rollout, RolloutConfig, SamplingConfig, load_model
    from autobucket.profile import _cpu_peak_rss_bytes, reset_peak_memory
    from autobucket.prompts import random_prompts

    torch.set_num_threads(1)
    model, _ = load_model(model_name, dtype=getattr(torch, dtype_name))
    prompts = random_prompts([16 * (i + 1) for i in range(16)], model.config.vocab_size, seed=0)
    sampling = SamplingConfig(max_new_tokens=32, eos_token_id=[])
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    budget_mb = {"invariant-half": parameter_bytes / 2 / 2**20, "invariant-none": 0.0}.get(kernels)
    config = RolloutConfig(kernels=kernels.split("-")[0], packed_weights_mb=budget_mb)
    rollout = Rollout(model, config=config)
    rollout.generate(prompts, sampling)
    reset_peak_memory(torch.device("cpu"))
    started = time.perf_counter()
    result = rollout.generate(prompts, sampling)
    seconds = time.perf_counter() - started
    return {"model": model_name, "dtype": dtype_name, "kernels": kernels, "peak_rss_bytes": _cpu_peak_rss_bytes(),
            "packed_weight_bytes": result.profile.packed_weight_bytes, "parameter_bytes": parameter_bytes,
            "call_s": seconds}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["bench-qwen2", "smollm2"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "DTYPE", "KERNELS"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default="results/kernel_memory.json")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(*args.one)))
        return
    rows = []
    for model in args.models:
        for dtype in args.dtypes:
            runs = {}
            for kernels in CONTENDERS:
                command = [sys.executable, __file__, "--one", model, dtype, kernels]
                output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                runs[kernels] = json.loads(output.strip().splitlines()[-1])
            torch_ops = runs["torch"]
            rows.append({"model": model, "dtype": dtype, "runs": runs})
            mib = 2**20
            for kernels, run in runs.items():
                print(f"{model} {dtype} {kernels:15s} peak RSS {run['peak_rss_bytes'] / mib:5.0f} MiB "
                      f"({run['peak_rss_bytes'] / torch_ops['peak_rss_bytes']:.2f}x torch), packed weights "
                      f"{run['packed_weight_bytes'] / mib:4.0f} MiB of {run['parameter_bytes'] / mib:.0f} MiB "
                      f"parameters, call {run['call_s']:.2f} s ({run['call_s'] / torch_ops['call_s']:.2f}x torch)",
                      flush=True)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
