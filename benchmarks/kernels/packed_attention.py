"""How to attend within a packed row, and how long a packed row should be, on this CPU.

    taskset -c 0 python benchmarks/kernels/packed_attention.py --repeats 5 --out results/packed_attention.json

1. Attention alone over spread's packed row (32 prompts of 16..512 tokens, T = 8,448; [1, 4, T, 64] fp32):
   per-prompt SDPA (what `packed_prefill` runs), SDPA with a dense block-diagonal mask (the fallback),
   and `flex_attention` with a block mask (torch.compile'd; its compile time is printed separately).
2. Packed prefill of spread on `bench-qwen2` in rows of at most 512 .. 9,000 tokens (first-fit of the
   length-descending prompts): the row size that is fastest per token.
One thread; interleaved repeats after a warm-up; medians; raw samples to JSON.
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

from autobucket.engine.batching.packed_prefill import bounds_of, prefill_packed
from autobucket.engine.model_access.hf_compat import forward_spec
from autobucket.models import build_tiny_model
from autobucket.planning.forms import SEGMENTS
from autobucket.prompts import random_prompts

LENGTHS = list(range(16, 513, 16))


def attention_section(repeats: int) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = sum(LENGTHS)
    q, k, v = (torch.randn(1, 4, total, 64) for _ in range(3))  # [1, heads, T, head_dim]
    prompt = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    column = torch.arange(total)
    dense = ((prompt[:, None] == prompt[None, :]) & (column[:, None] >= column[None, :]))[None, None]
    block_mask = create_block_mask(
        lambda b, h, qi, ki: (prompt[qi] == prompt[ki]) & (qi >= ki), 1, 1, total, total, device="cpu"
    )
    flex = torch.compile(flex_attention)
    started = time.perf_counter()
    flex(q, k, v, block_mask=block_mask)
    compile_s = time.perf_counter() - started
    bounds = bounds_of(LENGTHS)
    functions = {
        "per_prompt_sdpa": lambda: torch.cat(
            [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True) for s, e in bounds], 2
        ),
        "dense_mask_sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
        "flex_attention": lambda: flex(q, k, v, block_mask=block_mask),
    }
    samples = interleaved(functions, repeats)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"attention over T={total}: " + ", ".join(f"{n} {m:.1f} ms" for n, m in medians.items())
          + f"; flex compile {compile_s:.1f} s", flush=True)
    return {"tokens": total, "samples_ms": samples, "median_ms": medians, "flex_compile_s": compile_s}


def row_size_section(repeats: int) -> dict:
    model = build_tiny_model("bench-qwen2")
    spec = forward_spec(model)
    prompts = sorted(random_prompts(LENGTHS, model.config.vocab_size, seed=0), key=len, reverse=True)

    def rows_of(cap: int) -> list[list[list[int]]]:
        rows, row = [], []
        for prompt in prompts:
            if row and sum(map(len, row)) + len(prompt) > cap:
                rows.append(row)
                row = []
            row.append(prompt)
        return rows + [row]

    caps = (512, 1024, 2048, 4096, 9000)
    def prefill_rows(rows: list[list[list[int]]]):
        return lambda: [prefill_packed(model, spec, row, SEGMENTS) for row in rows]

    functions = {str(cap): prefill_rows(rows_of(cap)) for cap in caps}
    samples = interleaved(functions, repeats)
    medians = {cap: statistics.median(values) for cap, values in samples.items()}
    print("packed prefill of spread by row bound: " + ", ".join(
        f"<= {cap}: {len(rows_of(int(cap)))} rows {m:.0f} ms" for cap, m in medians.items()), flush=True)
    return {"samples_ms": samples, "median_ms": medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/packed_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    report = {"attention": attention_section(args.repeats), "row_size": row_size_section(args.repeats)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
