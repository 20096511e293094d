"""Two ways a bf16 model's GRPO-like call avoids a [rows, vocab] copy a step, each against the path before
it, alternating in one process (CPUs that run bf16 linears on the fixed-order kernel, AVX2 ones):
- `--change rounding` (default): linear outputs rounded to bf16 by the kernel as it copies them out
  (`fixed_order_linear_bf16`), against fp32 outputs rounded afterwards by torch;
- `--change scoring` (trainer-mode logprobs on): the bf16 log_softmax kernel reading the runner's widened
  fp32 logits (`trainer_log_softmax_at_widened`), against scoring a narrowed bf16 copy of them.

    quiet-run -- python benchmarks/studies/bf16_outputs.py --out results/bf16_outputs.json
    quiet-run -- python benchmarks/studies/bf16_outputs.py --change scoring --out results/bf16_scoring.json
    # smoke: --rounds 2 --prompts 2 --n 2 --new-tokens 4 --out /tmp/bf16o.json

The call is `shared_decode.py`'s (bench-qwen2 cast to bf16, `kernels="invariant"`, `--prompts` prompts of
ShareGPT-like lengths x `--n` samples, `--new-tokens` tokens, temperature 1, EOS off). One Rollout; the
"before" contender's calls run the previous path (patched in for each of its calls and restored after),
the "engine" contender's the engine's own. ABBA over `--rounds` rounds of fresh prompts
after a warm-up; tokens (and logprobs) must be equal (the two give the same bits). Medians, the ratio and raw samples
to JSON."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import abba_rounds, write_rounds
from shared_decode import call_sampling, round_prompts

from autobucket import Rollout, RolloutConfig
from autobucket.engine import selection
from autobucket.engine.kernels import packed_matmul, trainer_reductions
from autobucket.engine.kernels.library import load_invariant_kernels
from autobucket.engine.kernels.packed_matmul import fixed_order_op
from autobucket.models import build_tiny_model


@contextmanager
def torch_rounding() -> Iterator[None]:
    """bf16 rows' fixed-order GEMMs as fp32 outputs rounded by torch afterwards (the previous path)."""
    engine_path = packed_matmul._in_fp32

    def in_fp32(rows, pack, bias):
        if not (pack.fixed_order and not pack.unpacked and rows.dtype == torch.bfloat16):
            return engine_path(rows, pack, bias)
        bias_fp32 = None if bias is None else bias.float()
        out = torch.ops.autobucket.fixed_order_linear(rows.float(), pack.packed, bias_fp32, pack.out_features)
        return out.to(torch.bfloat16)

    packed_matmul._in_fp32 = in_fp32
    try:
        yield
    finally:
        packed_matmul._in_fp32 = engine_path


@contextmanager
def narrowed_scoring() -> Iterator[None]:
    """Trainer-mode bf16 logprobs scored on a narrowed bf16 copy of the widened logits (the previous path)."""
    engine_path = selection.log_softmax_at_widened
    selection.log_softmax_at_widened = lambda logits, tokens: trainer_reductions.log_softmax_at(
        logits.to(torch.bfloat16), tokens
    )
    try:
        yield
    finally:
        selection.log_softmax_at_widened = engine_path


BEFORE = {"rounding": torch_rounding, "scoring": narrowed_scoring}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--change", choices=sorted(BEFORE), default="rounding")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bf16_outputs.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_invariant_kernels()
    if fixed_order_op() is None:
        raise SystemExit("this CPU's kernel library has no vector fixed-order linear: nothing to compare")
    model = build_tiny_model("bench-qwen2").to(torch.bfloat16)
    rollout = Rollout(model, config=RolloutConfig(route="auto", kernels="invariant"))
    vocab = model.config.vocab_size

    logprobs = args.change == "scoring"

    scopes = {"engine": nullcontext, "before": BEFORE[args.change]}
    for scope in scopes.values():  # warm-up: packs made, the library loaded
        with scope():
            rollout.generate(round_prompts(vocab, args.prompts, args.seed), call_sampling(args, args.seed, logprobs))

    def call(scope):
        def run(prompts, seed):
            with scope():
                result = rollout.generate(prompts, call_sampling(args, seed, logprobs))
            return result.tokens, result.logprobs  # logprobs: None unless scoring

        return run

    seeds = range(args.seed + 1, args.seed + 1 + args.rounds)
    rounds = abba_rounds({name: call(scope) for name, scope in scopes.items()},
                         lambda seed: round_prompts(vocab, args.prompts, seed), seeds)  # fmt: skip
    medians = rounds["medians_ms"]
    print(f"{args.change}: engine {medians['engine']:.0f} ms, before {medians['before']:.0f} ms, ratio of medians "
          f"{medians['engine'] / medians['before']:.3f}, median of the rounds' ratios {rounds['median_round_ratio']:.3f}; "
          f"tokens equal {rounds['outputs_equal']}")  # fmt: skip
    write_rounds(args.out, args, rounds)


if __name__ == "__main__":
    main()
