"""A bf16 model's fixed-order linears: outputs rounded to bf16 by the kernel as it copies them out
(`fixed_order_linear_bf16`), against fp32 outputs rounded afterwards by torch (the path before it), on the
GRPO-like bf16 call, alternating in one process, where a CPU runs bf16 linears on that kernel.

    quiet-run -- python benchmarks/bf16_outputs.py --out results/bf16_outputs.json
    # smoke: --rounds 2 --prompts 2 --n 2 --new-tokens 4 --out /tmp/bf16o.json

The call is `shared_decode.py`'s (bench-qwen2 cast to bf16, `kernels="invariant"`, `--prompts` prompts of
ShareGPT-like lengths x `--n` samples, `--new-tokens` tokens, temperature 1, EOS off). One Rollout; the
"torch rounding" contender's calls run `packed_matmul`'s fp32 GEMM with `.to(torch.bfloat16)` after it
(restored after each call), the other the engine's path. ABBA over `--rounds` rounds of fresh prompts
after a warm-up; tokens must be equal (the two give the same bits). Medians, the ratio and raw samples
to JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from shared_decode import round_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.coefficients.file import host_cpu
from autobucket.engine.kernels import packed_matmul
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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

    def sampling(seed: int) -> SamplingConfig:
        return SamplingConfig(max_new_tokens=args.new_tokens, eos_token_id=[], n=args.n, temperature=1.0, seed=seed,
                              continuous_batch_size=args.prompts * args.n)  # fmt: skip

    contenders = {"kernel rounding": nullcontext, "torch rounding": torch_rounding}
    for scope in contenders.values():  # warm-up: packs made, the library loaded
        with scope():
            rollout.generate(round_prompts(vocab, args.prompts, args.seed), sampling(args.seed))
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    equal = True
    for index in range(args.rounds):
        seed = args.seed + 1 + index
        prompts, tokens = round_prompts(vocab, args.prompts, seed), {}
        for name in contenders if index % 2 == 0 else reversed(list(contenders)):  # ABBA
            with contenders[name]():
                started = time.perf_counter()
                tokens[name] = rollout.generate(prompts, sampling(seed)).tokens
                samples[name].append((time.perf_counter() - started) * 1e3)
        equal = equal and tokens["kernel rounding"] == tokens["torch rounding"]
        ratio = samples["kernel rounding"][-1] / samples["torch rounding"][-1]
        print(f"round {index}: kernel rounding {samples['kernel rounding'][-1]:.0f} ms, torch rounding "
              f"{samples['torch rounding'][-1]:.0f} ms, ratio {ratio:.3f}")  # fmt: skip
    medians = {name: statistics.median(values) for name, values in samples.items()}
    ratios = [a / b for a, b in zip(samples["kernel rounding"], samples["torch rounding"], strict=True)]
    print(f"call: kernel rounding {medians['kernel rounding']:.0f} ms, torch rounding {medians['torch rounding']:.0f} "
          f"ms, ratio of medians {medians['kernel rounding'] / medians['torch rounding']:.3f}, median of the rounds' "
          f"ratios {statistics.median(ratios):.3f}; tokens equal {equal}")  # fmt: skip
    record = {"cpu": host_cpu(), "torch": torch.__version__, "args": vars(args), "medians_ms": medians,
              "round_ratios": ratios, "tokens_equal": equal, "samples_ms": samples}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
