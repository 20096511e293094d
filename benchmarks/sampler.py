"""The sampler's inverse CDF: the engine's blockwise form against softmax + a full-row `cumsum`.

    quiet-run -- .venv/bin/python benchmarks/sampler.py --out results/sampler.json

`blockwise` is `autobucket.engine.selection.sample_inverse_cdf` (cumulative probability over
128-entry block sums, then one block scanned); `full_cumsum` is the form it replaced (softmax,
`cumsum` over the whole row, `searchsorted`). Each shape: random logits (scale 3) and draws, one
thread, both contenders interleaved after a warm-up, medians in ms; also the share of rows where the
two pick the same token (they differ only where rounding moves a boundary past a draw)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from autobucket.engine.selection import sample_inverse_cdf

SHAPES = [(8, 32_000), (32, 32_000), (64, 32_000), (64, 49_152), (64, 151_936)]


def full_cumsum(scores: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(scores.float(), dim=-1)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    draws = torch.minimum(uniforms.to(cdf)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, draws, right=True).squeeze(-1)
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()


CONTENDERS = {"blockwise": sample_inverse_cdf, "full_cumsum": full_cumsum}


def measure(rows: int, vocab: int, repeats: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, vocab, generator=generator) * 3
    uniforms = torch.rand(rows, dtype=torch.float64, generator=generator)
    samples: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for sampler in CONTENDERS.values():  # warm-up
        sampler(scores, uniforms)
    for _ in range(repeats):
        for name, sampler in CONTENDERS.items():
            started = time.perf_counter()
            sampler(scores, uniforms)
            samples[name].append((time.perf_counter() - started) * 1e3)
    same = (sample_inverse_cdf(scores, uniforms)[0] == full_cumsum(scores, uniforms)[0]).double().mean().item()
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {"rows": rows, "vocab": vocab, "medians_ms": medians, "samples_ms": samples, "same_token_share": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/sampler.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for rows, vocab in SHAPES:
        result = measure(rows, vocab, args.repeats, args.seed)
        results.append(result)
        m = result["medians_ms"]
        print(f"{rows} x {vocab}: blockwise {m['blockwise']:.2f} ms, full cumsum {m['full_cumsum']:.2f} ms "
              f"(ratio {m['blockwise'] / m['full_cumsum']:.2f}); same token {result['same_token_share']:.1%}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"shapes": results}, indent=1))


if __name__ == "__main__":
    main()
