"""fp32 linears, one thread: MKL (`F.linear`, the default kernels), oneDNN on a prepacked weight, and the
engine's fixed-order kernel (`kernels="invariant"` on AVX-512 and AVX2 builds), interleaved per shape.

    taskset -c 0 python benchmarks/kernels/fp32_linears.py --out results/fp32_linears.json

Shapes: bench-qwen2's and SmolLM2's projections and heads at a decode step's rows (8, 32) and at
prefill and trainer sizes (1,024 and 2,048 rows). Also printed: whether each kernel gave row 0 bitwise
the same output alone as inside the batch (MKL need not), and the largest difference from a float64
reference. Caches are flushed before every timed call. Medians, ratios to oneDNN, raw samples to JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
import torch.nn.functional as F
from interleave import interleaved

from autobucket.engine.kernels.packed_matmul import fixed_order_op, fixed_order_panels

# (rows, in_features, out_features)
SHAPES = [
    (8, 256, 256), (32, 256, 256), (32, 256, 1024), (32, 1024, 256), (32, 256, 32000),
    (32, 576, 1536), (32, 1536, 576), (32, 576, 49152), (1024, 576, 1536), (1024, 1536, 576),
    (2048, 256, 1024), (1024, 576, 49152),
]  # fmt: skip


def contenders(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> dict:
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, x.shape[0])
    panels, fixed_order = fixed_order_panels(weight), fixed_order_op()
    out_features = weight.shape[0]
    functions = {
        "mkl": lambda rows=x: F.linear(rows, weight, bias),
        "onednn": lambda rows=x: torch.ops.mkldnn._linear_pointwise(rows, onednn, bias, "none", [], ""),
    }
    if fixed_order is not None:
        functions["fixed_order"] = lambda rows=x: fixed_order(rows, panels, bias, out_features)
    return functions


@torch.inference_mode()
def measure_shape(rows: int, in_features: int, out_features: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(rows + in_features + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias = torch.randn(out_features, generator=generator)
    functions = contenders(x, weight, bias)
    reference = F.linear(x.double(), weight.double(), bias.double())
    checks = {}
    for name, function in functions.items():
        together = function()
        alone = function(x[:1])
        checks[name] = {"row_alone_bitwise": bool(torch.equal(alone, together[:1])),
                        "max_abs_error": (together.double() - reference).abs().max().item()}  # fmt: skip
    # every call finds its weight in DRAM, as in a model's forward (bench-qwen2's fp32 weights are 81 MB,
    # this machine's L3 32 MB): a 64 MB write between calls
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    samples = interleaved(functions, repeats, before=lambda: flush.fill_(1))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    gflop = 2 * rows * in_features * out_features / 1e9
    return {"shape": [rows, in_features, out_features], "medians_ms": medians, "samples_ms": samples,
            "gflops": {name: gflop / (ms / 1e3) for name, ms in medians.items()}, "checks": checks}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="results/fp32_linears.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for rows, in_features, out_features in SHAPES:
        result = measure_shape(rows, in_features, out_features, args.repeats)
        results.append(result)
        m, g, c = result["medians_ms"], result["gflops"], result["checks"]
        line = " | ".join(f"{name} {m[name]:.3f} ms ({g[name]:.0f} GFLOPS, row alone {'=' if c[name]['row_alone_bitwise'] else '!='})"
                          for name in m)  # fmt: skip
        ratio = f"; fixed order / oneDNN {m['fixed_order'] / m['onednn']:.2f}" if "fixed_order" in m else ""
        print(f"{rows} x {in_features} x {out_features}: {line}{ratio}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"shapes": results}, indent=1))


if __name__ == "__main__":
    main()
