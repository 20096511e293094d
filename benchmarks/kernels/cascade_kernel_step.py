"""The GRPO-like call's cascade decode steps on the kernel step against the direct step, in one process.

    taskset -c 0 python benchmarks/kernels/cascade_kernel_step.py --repeats 7 --out results/cascade_kernel_step.json

bench-qwen2 fp32, `kernels="invariant"`, 8 ShareGPT-like prompts x n = 8, 64 new tokens, T = 1, EOS off
(benchmarks/shared_decode.py's call): every decode step reads the prompts' shared K/V (cascade decode).
`kernel step`: the engine as it is, each step calling the kernels straight (`engine/decode/ops.py`, `kernel_ops`);
`direct step`: the same call with the kernel step declining cascade steps, so the direct step runs them
through the model's modules and the attention interface (what the engine did before the kernel step took
cascade steps). Same rollout object, calls alternated after a warm-up; the sampled tokens and logprobs
must be equal. Medians, the ratio kernel / direct, raw samples to JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import interleaved

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.decode import ops as decode_ops
from autobucket.engine.intercept.attention import chosen_attention
from autobucket.engine.kernels.shared_prefix_attention import SharedPrefixAttention
from autobucket.models import build_tiny_model
from autobucket.prompts import random_prompts
from autobucket.tools.workloads import sharegpt_like_lengths


class CascadeDeclined:
    """Inside the block, the kernel ops decline every shared-prefix step (the module ops run it)."""

    def __enter__(self) -> None:
        self.kernel_ops = taken = decode_ops.kernel_ops

        def declining(*args):
            return None if isinstance(chosen_attention(), SharedPrefixAttention) else taken(*args)

        decode_ops.kernel_ops = declining

    def __exit__(self, *exc) -> None:
        decode_ops.kernel_ops = self.kernel_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (pin as many cores)")
    parser.add_argument("--out", default="results/cascade_kernel_step.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_tiny_model("bench-qwen2")
    prompts = random_prompts(sharegpt_like_lengths(8, seed=1), model.config.vocab_size, seed=1)
    sampling = SamplingConfig(max_new_tokens=64, eos_token_id=[], n=8, temperature=1.0, seed=0, logprobs=True)
    rollout = Rollout(model, config=RolloutConfig(route="aligned", kernels="invariant", persist_costs=False))
    results = {}

    def kernel_step():
        results["kernel step"] = rollout.generate(prompts, sampling)

    def direct_step():
        with CascadeDeclined():
            results["direct step"] = rollout.generate(prompts, sampling)

    samples = interleaved({"kernel step": kernel_step, "direct step": direct_step}, args.repeats)
    kernel, direct = results["kernel step"], results["direct step"]
    assert kernel.profile.shared_kv_rows > 0, "the call did not share its prompts' K/V"
    equal = kernel.tokens == direct.tokens and kernel.logprobs == direct.logprobs
    medians = {name: statistics.median(values) for name, values in samples.items()}
    ratio = medians["kernel step"] / medians["direct step"]
    print(f"GRPO-like call, {args.threads} thread(s), medians of {args.repeats}: kernel step {medians['kernel step']:.0f} ms, "
          f"direct step {medians['direct step']:.0f} ms, ratio {ratio:.3f}; tokens and logprobs equal: {equal}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    record = {"threads": args.threads, "repeats": args.repeats, "medians_ms": medians, "ratio_kernel_to_direct": ratio,
              "tokens_and_logprobs_equal": equal, "samples_ms": samples}  # fmt: skip
    Path(args.out).write_text(json.dumps(record, indent=1))
    if not equal:
        raise SystemExit("the kernel step's tokens or logprobs differ from the direct step's")


if __name__ == "__main__":
    main()
