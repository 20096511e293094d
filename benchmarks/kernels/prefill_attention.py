"""Prefill attention alone: the invariant kernel against SDPA's flash kernel, on real models' head shapes.

    taskset -c 0 python benchmarks/kernels/prefill_attention.py --repeats 7 --out results/prefill_attention.json

One causal prompt of `--length` tokens per shape ([1, heads, L, head_dim] queries over [1, kv_heads, L,
head_dim] keys), fp32 and bf16: `invariant` is `torch.ops.autobucket.invariant_attention` (what
`kernels="invariant"` runs for a prefill), `flash` is SDPA with `is_causal` and its K/V heads repeated
(what transformers' SDPA path runs). The benchmark also checks that the kernel's prefill equals its own
decode of the last query bitwise (the invariance the speed must not cost). One thread; interleaved repeats
after a warm-up; medians and ratios; raw samples to JSON.

    perf record -o prefill.perf taskset -c 0 python benchmarks/kernels/prefill_attention.py --length 512 \
        --shapes bench-qwen2 --dtypes float32 --profile-calls 1500   # the kernel alone, for a profiler

`--profile-calls N` runs only the invariant kernel, N calls per shape and dtype, with no contest and no JSON,
so a sampling profiler's samples are the kernel's parts (scores, softmax, P.V, key transpose).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
import torch.nn.functional as F
from interleave import interleaved

from autobucket.engine.kernels.library import load_invariant_kernels

SHAPES = {  # name -> (query heads, K/V heads, head_dim)
    "smollm2": (9, 3, 64),
    "bench-qwen2": (4, 2, 64),
    "qwen2.5-0.5b": (14, 2, 64),
    "llama-head128": (8, 2, 128),
}


def contenders(heads: int, kv_heads: int, head_dim: int, length: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, length, head_dim, generator=generator).to(dtype)
    key, value = (torch.randn(1, kv_heads, length, head_dim, generator=generator).to(dtype) for _ in range(2))
    scale = head_dim**-0.5
    none = torch.empty(0, dtype=torch.bool)

    def invariant():
        return torch.ops.autobucket.invariant_attention(query, key, value, none, True, scale)

    def flash():
        repeat = heads // kv_heads
        k, v = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        return F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scale)

    last = torch.ops.autobucket.invariant_attention(query[:, :, -1:], key, value, none, True, scale)
    agrees = torch.equal(invariant()[:, -1:], last)
    return {"invariant": invariant, "flash": flash}, agrees


def profile_calls(args) -> None:
    """The invariant kernel alone, `args.profile_calls` calls per shape and dtype, for a sampling profiler."""
    with torch.inference_mode():
        for name in args.shapes:
            for dtype_name in args.dtypes:
                heads, _, head_dim = SHAPES[name]
                invariant = contenders(*SHAPES[name], args.length, getattr(torch, dtype_name))[0]["invariant"]
                start = time.perf_counter()
                for _ in range(args.profile_calls):
                    invariant()
                per_call_s = (time.perf_counter() - start) / args.profile_calls
                pairs = heads * args.length * (args.length + 1) / 2  # causal (query, key) pairs over all heads
                print(f"{name} {dtype_name} L={args.length}: {per_call_s * 1e3:.3f} ms a call (mean of "
                      f"{args.profile_calls}), {4 * head_dim * pairs / per_call_s / 1e9:.1f} GFLOPS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--out", default="results/prefill_attention.json")
    parser.add_argument("--profile-calls", type=int, default=0, help="only run the invariant kernel this many times")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_invariant_kernels()
    if args.profile_calls > 0:
        profile_calls(args)
        return
    report = []
    with torch.inference_mode():
        for name in args.shapes:
            for dtype_name in args.dtypes:
                functions, agrees = contenders(*SHAPES[name], args.length, getattr(torch, dtype_name))
                samples = interleaved(functions, args.repeats)
                medians = {k: statistics.median(v) for k, v in samples.items()}
                ratio = medians["invariant"] / medians["flash"]
                print(
                    f"{name} {dtype_name} L={args.length}: invariant {medians['invariant']:.2f} ms, flash "
                    f"{medians['flash']:.2f} ms (invariant / flash {ratio:.2f}; prefill == decode bitwise: {agrees})"
                )
                report.append(dict(shape=name, dtype=dtype_name, length=args.length, medians_ms=medians,
                                   ratio=ratio, prefill_equals_decode=agrees, samples_ms=samples))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
