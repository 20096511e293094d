"""What trainer-mode logprobs cost an RL call, with the logsumexp kernel and with torch's op, interleaved in
one process; and the op alone.

    quiet-run -- .venv/bin/python benchmarks/trainer_logprobs.py --out results/trainer_logprobs.json
    # smoke: --prompts 2 --n 4 --new-tokens 8 --repeats 1 --op-repeats 3 --out /tmp/tl/smoke.json

The call: `benchmarks/shared_decode.py`'s GRPO-like one (`--prompts` 8 fresh ShareGPT-like prompts x `--n`
8 samples, `--new-tokens` 64, temperature 1, EOS off, `kernels="invariant"`, cascade decode on), each round
with fresh prompts and seed. Contenders, interleaved per round after `--warmup` rounds, each its own Rollout:
- "no logprobs": `logprobs=False`;
- "trainer logprobs, kernel": `logprobs=True` (the default `logprobs_mode="trainer"`, which the TRL adapter
  uses): each decode step's `logit - logsumexp(logits)` with the logsumexp through
  `engine/kernels/trainer_logsumexp.py` (`csrc/trainer_logsumexp.cpp`);
- "trainer logprobs, torch op": the same with the kernel refused (its `_takes` patched to False around
  this contender's calls only), so torch's `logsumexp` runs, as before the kernel.
The two trainer contenders must return the same tokens and logprobs bitwise (checked each round).

The op: `torch.logsumexp(x, -1, keepdim=True)` against the kernel on [rows, vocab] fp32 logits (scale
3), one thread, interleaved after a warm-up, with the logits in cache (`warm`) or after a 64 MB write
(`cold`, as a decode step's logits arrive behind the head's weight stream).

Prints medians and ratios; raw samples, the CPU model and torch's version go to `--out`."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from shared_decode import CONTINUOUS_BATCH_SIZE, round_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.coefficients.file import host_cpu
from autobucket.engine.kernels import trainer_logsumexp
from autobucket.models import build_tiny_model
from autobucket.threads import set_torch_threads

NONE, KERNEL, TORCH_OP = "no logprobs", "trainer logprobs, kernel", "trainer logprobs, torch op"
OP_SHAPES = [(8, 32_000), (64, 32_000), (64, 49_152), (64, 151_936)]
CACHE_FLUSH_BYTES = 64 << 20


@contextmanager
def torch_logsumexp_only():
    saved = trainer_logsumexp._takes
    trainer_logsumexp._takes = lambda logits: False
    try:
        yield
    finally:
        trainer_logsumexp._takes = saved


def call(rollout: Rollout, args, prompts: list[list[int]], seed: int, logprobs: bool, torch_op: bool):
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, eos_token_id=[], n=args.n, temperature=1.0, seed=seed,
                              continuous_batch_size=CONTINUOUS_BATCH_SIZE, logprobs=logprobs)  # fmt: skip
    with torch_logsumexp_only() if torch_op else nullcontext():
        started = time.perf_counter()
        result = rollout.generate(prompts, sampling)
        return (time.perf_counter() - started) * 1e3, result


def measure_calls(args, model) -> dict:
    contenders = {NONE: (False, False), KERNEL: (True, False), TORCH_OP: (True, True)}
    rollouts = {name: Rollout(model, config=RolloutConfig(route="auto", kernels="invariant")) for name in contenders}
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    bitwise_rounds = 0
    for index in range(args.warmup + args.repeats):
        seed = args.seed + index
        prompts = round_prompts(model.config.vocab_size, args.prompts, seed)
        results = {}
        for name, (logprobs, torch_op) in contenders.items():
            ms, results[name] = call(rollouts[name], args, prompts, seed, logprobs, torch_op)
            if index >= args.warmup:
                samples[name].append(ms)
        same = results[KERNEL].tokens == results[TORCH_OP].tokens and results[KERNEL].logprobs == results[TORCH_OP].logprobs
        if not same:
            raise SystemExit(f"round {index}: the kernel's trainer logprobs differ from torch's op's")
        bitwise_rounds += index >= args.warmup
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {"medians_ms": medians, "samples_ms": samples, "bitwise_equal_rounds": bitwise_rounds}


def measure_op(rows: int, vocab: int, repeats: int, cache: str) -> dict:
    logits = 3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows + vocab))
    flush = torch.empty(CACHE_FLUSH_BYTES, dtype=torch.uint8) if cache == "cold" else None
    contenders = {"kernel": torch.ops.autobucket.trainer_logsumexp,
                  "torch": lambda x: torch.logsumexp(x, dim=-1, keepdim=True)}  # fmt: skip
    if not torch.equal(contenders["kernel"](logits), contenders["torch"](logits)):
        raise SystemExit(f"{rows} x {vocab}: the kernel differs from torch.logsumexp")
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, op in contenders.items():
            if flush is not None:
                flush.fill_(1)
            started = time.perf_counter()
            op(logits)
            samples[name].append((time.perf_counter() - started) * 1e3)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {"rows": rows, "vocab": vocab, "cache": cache, "medians_ms": medians, "samples_ms": samples}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--op-repeats", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/trainer_logprobs.json")
    args = parser.parse_args(argv)
    threads = set_torch_threads(1)
    if not trainer_logsumexp.available():
        raise SystemExit("the trainer_logsumexp kernel is not available here (kernel library or torch's MKL)")
    cpu = host_cpu()
    print(f"CPU: {cpu}; torch {torch.__version__}; {threads} thread(s)")
    ops = []
    for rows, vocab in OP_SHAPES:
        for cache in ("warm", "cold"):
            result = measure_op(rows, vocab, args.op_repeats, cache)
            ops.append(result)
            m = result["medians_ms"]
            print(f"op {rows} x {vocab} {cache}: kernel {m['kernel']:.2f} ms, torch {m['torch']:.2f} ms, "
                  f"kernel / torch {m['kernel'] / m['torch']:.2f}")  # fmt: skip
    calls = measure_calls(args, build_tiny_model("bench-qwen2"))
    m = calls["medians_ms"]
    print(f"\nGRPO-like call (bench-qwen2 fp32, {args.prompts} prompts x n = {args.n}, {args.new_tokens} new tokens, "
          f"kernels='invariant'), medians of {args.repeats}:")  # fmt: skip
    for name in m:
        print(f"  {name}: {m[name] / 1e3:.3f} s, / no logprobs {m[name] / m[NONE]:.3f}")
    print(f"  kernel / torch op: {m[KERNEL] / m[TORCH_OP]:.3f}; tokens and logprobs bitwise equal in "
          f"{calls['bitwise_equal_rounds']} of {args.repeats} rounds")  # fmt: skip
    payload = {"argv": sys.argv, "config": vars(args), "cpu": cpu, "torch": torch.__version__, "ops": ops, "calls": calls}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
