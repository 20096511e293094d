"""Decode attention alone: the invariant kernel with and without its K/V prefetch, on a decode step's cache.

    taskset -c 0 python benchmarks/kernels/decode_attention.py --repeats 21 --out results/decode_attention.json

One query per row over a static cache ([rows, kv_heads, columns, head_dim], bench-qwen2's heads: 4 query
heads over 2 K/V heads of 64), `--layers` layers' caches in turn, as a decode step reads them; fp32 and
bf16. A 64 MB write runs before every timed call, so the cache comes from DRAM, as it does in a step
whose weights have just streamed through. The two contenders are this tree's kernel built twice beside
the library, with its decode prefetch fixed on and off (`AUTOBUCKET_DECODE_PREFETCH`; the form is this
CPU's: keys ahead on Intel, a block ahead on AMD CPUs), each under its own operator namespace; the
benchmark checks that their outputs are bitwise equal. To compare two versions of the kernel instead,
use `attention_ab.py`. Interleaved repeats after a warm-up;
medians, the cache's read rate, ratios; raw samples to JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import interleaved
from revision_ab import build_tree_kernel

from autobucket.engine.kernels.library import load_invariant_kernels

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
PREFETCH_BUILDS = {True: "autobucket_decode_prefetch_on", False: "autobucket_decode_prefetch_off"}  # namespaces


def decode_layers(rows: int, context: int, layers: int, dtype: torch.dtype) -> list[tuple]:
    """Per layer: query [rows, 4, 1, 64], K and V [rows, 2, context + 64, 64] (64 columns unused, as
    a static cache has room left), and each row allowed its first `context` columns."""
    generator = torch.Generator().manual_seed(rows + context)
    columns = context + 64
    out = []
    for _ in range(layers):
        key, value = (
            torch.randn(rows, KV_HEADS, columns, HEAD_DIM, generator=generator).to(dtype) for _ in range(2)
        )
        query = torch.randn(rows, HEADS, 1, HEAD_DIM, generator=generator).to(dtype)
        allowed = torch.zeros(rows, 1, columns, dtype=torch.bool)
        allowed[:, :, :context] = True
        out.append((query, key, value, allowed))
    return out


def build_prefetch_variants() -> None:
    """The attention built with its decode prefetch fixed on and off, under PREFETCH_BUILDS' namespaces."""
    for prefetch, namespace in PREFETCH_BUILDS.items():
        build_tree_kernel("invariant_attention.cpp", namespace, {"AUTOBUCKET_DECODE_PREFETCH": int(prefetch)})


def attend_all(layers: list[tuple], prefetch: bool):
    op = getattr(torch.ops, PREFETCH_BUILDS[prefetch]).invariant_attention

    def run() -> list[torch.Tensor]:
        return [op(q, k, v, a, False, HEAD_DIM**-0.5) for q, k, v, a in layers]

    return run


def measure(rows: int, context: int, layers: int, dtype: torch.dtype, repeats: int) -> dict:
    cache = decode_layers(rows, context, layers, dtype)
    functions = {"prefetch": attend_all(cache, True), "no_prefetch": attend_all(cache, False)}
    equal = all(
        torch.equal(a, b) for a, b in zip(functions["prefetch"](), functions["no_prefetch"](), strict=True)
    )
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    samples = interleaved(functions, repeats, before=lambda: flush.fill_(1))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    cache_mb = 2 * layers * rows * KV_HEADS * context * HEAD_DIM * torch.finfo(dtype).bits / 8 / 1e6
    return {"rows": rows, "context": context, "layers": layers, "dtype": str(dtype).removeprefix("torch."),
            "medians_ms": medians, "samples_ms": samples, "cache_mb": cache_mb, "bitwise_equal": equal,
            "ratio_prefetch": medians["prefetch"] / medians["no_prefetch"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", default="results/decode_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_invariant_kernels()
    build_prefetch_variants()
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for context in args.contexts:
            result = measure(args.rows, context, args.layers, dtype, args.repeats)
            results.append(result)
            m = result["medians_ms"]
            rates = {name: result["cache_mb"] / ms for name, ms in m.items()}
            print(f"{result['dtype']} rows {args.rows} context {context}: prefetch {m['prefetch']:.2f} ms "
                  f"({rates['prefetch']:.1f} GB/s), none {m['no_prefetch']:.2f} ms ({rates['no_prefetch']:.1f} GB/s), "
                  f"ratio {result['ratio_prefetch']:.3f}; bitwise equal {result['bitwise_equal']}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
