"""The sampler's inverse CDF: the kernel library's op, the engine's torch-op blockwise form and softmax +
a full-row `cumsum`, interleaved in one process.

    quiet-run -- .venv/bin/python benchmarks/kernels/sampler.py --out results/sampler.json

`kernel` is `autobucket.engine.selection.sample_inverse_cdf` where the kernel library builds with AVX2
or AVX-512 (`csrc/sample_inverse_cdf.cpp`: two sweeps over each row, nothing written but the answer);
`blockwise` is `blockwise_inverse_cdf`, its torch-op form (cumulative probability over 128-entry block
sums, then one block scanned); `full_cumsum` the form that replaced (softmax, `cumsum` over the whole
row, `searchsorted`). Each shape: random logits (scale 3) and draws, one thread, the contenders
interleaved after a warm-up, medians in ms, with the scores in cache (`warm`) or after a 64 MB write
(`cold`: a decode step's logits arrive behind the head's weight stream); also the share of rows where
each picks the same token as `full_cumsum` (they differ only where rounding moves a boundary past a
draw). Raw samples, the CPU model and torch's version go to `--out`."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from autobucket.costs.calibration_file import host_cpu
from autobucket.engine.sampling.inverse_cdf import _sampler_kernel, blockwise_inverse_cdf, sample_inverse_cdf

SHAPES = [(8, 32_000), (32, 32_000), (64, 32_000), (64, 49_152), (64, 151_936)]


def full_cumsum(scores: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(scores.float(), dim=-1)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    draws = torch.minimum(uniforms.to(cdf)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, draws, right=True).squeeze(-1)
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()


CONTENDERS = {"kernel": sample_inverse_cdf, "blockwise": blockwise_inverse_cdf, "full_cumsum": full_cumsum}
CACHE_FLUSH_BYTES = 64 << 20


def measure(rows: int, vocab: int, repeats: int, seed: int, cache: str) -> dict:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, vocab, generator=generator) * 3
    uniforms = torch.rand(rows, dtype=torch.float64, generator=generator)
    flush = torch.empty(CACHE_FLUSH_BYTES, dtype=torch.uint8) if cache == "cold" else None
    samples: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for sampler in CONTENDERS.values():  # warm-up
        sampler(scores, uniforms)
    for _ in range(repeats):
        for name, sampler in CONTENDERS.items():
            if flush is not None:
                flush.fill_(1)
            started = time.perf_counter()
            sampler(scores, uniforms)
            samples[name].append((time.perf_counter() - started) * 1e3)
    reference = full_cumsum(scores, uniforms)[0]
    same = {name: (sampler(scores, uniforms)[0] == reference).double().mean().item() for name, sampler in CONTENDERS.items()}
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {"rows": rows, "vocab": vocab, "cache": cache, "medians_ms": medians, "samples_ms": samples,
            "same_token_share_vs_full_cumsum": same}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/sampler.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = host_cpu()
    print(f"CPU: {cpu}; torch {torch.__version__}; kernel op: {'yes' if _sampler_kernel() else 'no (torch form)'}")
    results = []
    for rows, vocab in SHAPES:
        for cache in ("warm", "cold"):
            result = measure(rows, vocab, args.repeats, args.seed, cache)
            results.append(result)
            m, same = result["medians_ms"], result["same_token_share_vs_full_cumsum"]
            print(f"{rows} x {vocab} {cache}: kernel {m['kernel']:.2f} ms, blockwise {m['blockwise']:.2f} ms, full cumsum "
                  f"{m['full_cumsum']:.2f} ms; kernel / blockwise {m['kernel'] / m['blockwise']:.2f}; same token as "
                  f"full cumsum: kernel {same['kernel']:.1%}, blockwise {same['blockwise']:.1%}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    payload = {"cpu": cpu, "torch": torch.__version__, "kernel_op": _sampler_kernel() is not None, "shapes": results}
    Path(args.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
