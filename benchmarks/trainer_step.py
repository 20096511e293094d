"""A trainer's forward + backward with and without `autobucket.invariant(model)`, interleaved.

    quiet-run -- python benchmarks/trainer_step.py --model bench-qwen2 --rows 8 --length 256 --out results/trainer_step.json

One teacher-forced forward over a left-padded batch (position ids over real tokens), TRL's logprob
formula, a loss, `backward()` and an SGD step (so every scoped step repacks, as in training); medians
of `--repeats` after one warm-up each; `pack_ms` is the repacking inside the scoped steps."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from autobucket import invariant, load_model, trainer_logprobs
from autobucket.engine.batching.prefill import positions_from_mask


def step(model, optimizer, ids, mask, scoped: bool) -> float:
    started = time.perf_counter()
    with invariant(model) if scoped else contextlib.nullcontext():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        loss = -trainer_logprobs(logits[:, :-1], ids[:, 1:]).float()[mask[:, 1:].bool()].mean()
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-qwen2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/trainer_step.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, _ = load_model(args.model, dtype=args.dtype)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (args.rows, args.length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(args.rows):  # left padding of different widths
        mask[row, : row * args.length // (2 * args.rows)] = 0
    samples: dict[str, list[float]] = {"plain": [], "invariant": []}
    step(model, optimizer, ids, mask, False), step(model, optimizer, ids, mask, True)  # warm-up
    with invariant(model) as packs:
        pass
    pack_ms_before = packs.pack_ms
    for _ in range(args.repeats):
        samples["plain"].append(step(model, optimizer, ids, mask, False))
        samples["invariant"].append(step(model, optimizer, ids, mask, True))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    pack_ms = (packs.pack_ms - pack_ms_before) / args.repeats
    print(f"{args.model} {args.dtype} {args.rows}x{args.length}: forward+backward+step plain {medians['plain']:.1f} ms, "
          f"invariant {medians['invariant']:.1f} ms (ratio {medians['invariant'] / medians['plain']:.3f}; "
          f"repacking {pack_ms:.1f} ms of it)")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "medians_ms": medians, "pack_ms": pack_ms,
                                          "samples_ms": samples}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
