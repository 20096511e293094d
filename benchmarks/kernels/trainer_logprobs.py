"""What trainer-mode logprobs cost an RL call, with the trainer-reduction kernels and with torch's ops,
interleaved in one process; and the ops alone.

    quiet-run -- .venv/bin/python benchmarks/kernels/trainer_logprobs.py --out results/trainer_logprobs.json
    # a bf16 model: --dtype bf16; smoke: --prompts 2 --n 4 --new-tokens 8 --repeats 1 --op-repeats 3

The call: `benchmarks/shared_decode.py`'s GRPO-like one (`--prompts` 8 fresh ShareGPT-like prompts x `--n`
8 samples, `--new-tokens` 64, temperature 1, EOS off, `kernels="invariant"`, cascade decode on, the model in
`--dtype`), each round with fresh prompts and seed. Contenders, interleaved per round after `--warmup`
rounds, each its own Rollout:
- "no logprobs": `logprobs=False`;
- "trainer logprobs, kernel": `logprobs=True` (the default `logprobs_mode="trainer"`, which the TRL adapter
  uses): each decode step's fp32 `logit - logsumexp(logits)` or bf16 `log_softmax(logits)[token]` through
  `engine/kernels/trainer_reductions.py` (`csrc/trainer_logprobs.cpp`);
- "trainer logprobs, torch op": the same with the kernels refused (patched around this contender's calls
  only), so torch's `logsumexp` / `log_softmax` run, as before the kernels.
The two trainer contenders must return the same tokens and logprobs bitwise (checked each round).

The ops: `torch.logsumexp(x, -1, keepdim=True)` against the fp32 kernel, and `torch.log_softmax(x,
-1).gather(token)` against the bf16 one (where each runs), on [rows, vocab] logits (scale 3), one thread,
interleaved after a warm-up, with the logits in cache (`warm`) or after a 64 MB write (`cold`, as a decode
step's logits arrive behind the head's weight stream).

Prints medians and ratios; raw samples, the CPU model and torch's version go to `--out`."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import interleaved
from shared_decode import call_sampling, round_prompts

from autobucket import Rollout, RolloutConfig
from autobucket.costs.calibration_file import host_cpu
from autobucket.engine.kernels import trainer_reductions
from autobucket.models import build_tiny_model
from autobucket.threads import set_torch_threads

NONE, KERNEL, TORCH_OP = "no logprobs", "trainer logprobs, kernel", "trainer logprobs, torch op"
OP_SHAPES = [(8, 32_000), (64, 32_000), (64, 49_152), (64, 151_936)]
CACHE_FLUSH_BYTES = 64 << 20


@contextmanager
def torch_ops_only():
    """The kernels refused: trainer-mode logprobs take torch's logsumexp / log_softmax."""
    saved = trainer_reductions._takes_fp32, trainer_reductions._takes_bf16
    trainer_reductions._takes_fp32 = lambda logits: False
    trainer_reductions._takes_bf16 = lambda *args, **kwargs: False  # the widened bf16 logits' kernel too
    try:
        yield
    finally:
        trainer_reductions._takes_fp32, trainer_reductions._takes_bf16 = saved


def call(rollout: Rollout, args, prompts: list[list[int]], seed: int, logprobs: bool, torch_op: bool):
    sampling = call_sampling(args, seed, logprobs)
    with torch_ops_only() if torch_op else nullcontext():
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
    # rounds differ in their prompts' lengths (and this VM's speed drifts): the same round's contenders compared
    paired = [kernel / torch_op for kernel, torch_op in zip(samples[KERNEL], samples[TORCH_OP], strict=True)]
    return {"medians_ms": medians, "samples_ms": samples, "bitwise_equal_rounds": bitwise_rounds,
            "kernel_over_torch_op_per_round": paired}  # fmt: skip


def measure_op(dtype: torch.dtype, rows: int, vocab: int, repeats: int, cache: str) -> dict:
    generator = torch.Generator().manual_seed(rows + vocab)
    logits = (3 * torch.randn(rows, vocab, generator=generator)).to(dtype)
    tokens = torch.randint(0, vocab, (rows,), generator=generator)
    flush = torch.empty(CACHE_FLUSH_BYTES, dtype=torch.uint8) if cache == "cold" else None
    if dtype == torch.float32:
        contenders = {"kernel": lambda x, t: torch.ops.autobucket.trainer_logsumexp(x),
                      "torch": lambda x, t: torch.logsumexp(x, dim=-1, keepdim=True)}  # fmt: skip
    else:
        contenders = {"kernel": torch.ops.autobucket.trainer_log_softmax_at,
                      "torch": lambda x, t: torch.log_softmax(x, dim=-1).gather(-1, t[:, None])[:, 0]}  # fmt: skip
    if not torch.equal(contenders["kernel"](logits, tokens), contenders["torch"](logits, tokens)):
        raise SystemExit(f"{dtype} {rows} x {vocab}: the kernel differs from torch's op")
    calls = {name: functools.partial(op, logits, tokens) for name, op in contenders.items()}
    samples = interleaved(calls, repeats, before=(lambda: flush.fill_(1)) if flush is not None else None)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {"dtype": str(dtype), "rows": rows, "vocab": vocab, "cache": cache, "medians_ms": medians, "samples_ms": samples}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--op-repeats", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the model's dtype for the call")
    parser.add_argument("--out", default="results/trainer_logprobs.json")
    args = parser.parse_args(argv)
    threads = set_torch_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    available = {torch.float32: trainer_reductions.fp32_available(), torch.bfloat16: trainer_reductions.bf16_available()}
    if not available[dtype]:
        raise SystemExit(f"the {args.dtype} kernel does not run here (kernel library, torch's MKL, or not an AVX2 build)")
    cpu = host_cpu()
    print(f"CPU: {cpu}; torch {torch.__version__}; {threads} thread(s)")
    ops = []
    for op_dtype in (op_dtype for op_dtype, there in available.items() if there):
        for rows, vocab in OP_SHAPES:
            for cache in ("warm", "cold"):
                result = measure_op(op_dtype, rows, vocab, args.op_repeats, cache)
                ops.append(result)
                m = result["medians_ms"]
                name = "logsumexp" if op_dtype == torch.float32 else "log_softmax at token, bf16"
                print(f"{name} {rows} x {vocab} {cache}: kernel {m['kernel']:.2f} ms, torch {m['torch']:.2f} ms, "
                      f"kernel / torch {m['kernel'] / m['torch']:.2f}")  # fmt: skip
    calls = measure_calls(args, build_tiny_model("bench-qwen2").to(dtype))
    m = calls["medians_ms"]
    print(f"\nGRPO-like call (bench-qwen2 {args.dtype}, {args.prompts} prompts x n = {args.n}, {args.new_tokens} new tokens, "
          f"kernels='invariant'), medians of {args.repeats}:")  # fmt: skip
    for name in m:
        print(f"  {name}: {m[name] / 1e3:.3f} s, / no logprobs {m[name] / m[NONE]:.3f}")
    paired = calls["kernel_over_torch_op_per_round"]
    print(f"  kernel / torch op: {m[KERNEL] / m[TORCH_OP]:.3f} of medians, {statistics.median(paired):.3f} median of the "
          f"rounds' ratios ({min(paired):.2f}-{max(paired):.2f}); tokens and logprobs bitwise equal in "
          f"{calls['bitwise_equal_rounds']} of {args.repeats} rounds")  # fmt: skip
    payload = {"argv": sys.argv, "config": vars(args), "cpu": cpu, "torch": torch.__version__, "ops": ops, "calls": calls}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
