"""The fused elementwise kernels against the model's own code: the rotary embedding against the modeling
module's `apply_rotary_pos_emb`, SiLU-and-multiply against `F.silu(gate) * up`, RMSNorm against the
module, each alone, and whole rollouts with all of them on and all off.

    taskset -c 0 python benchmarks/kernels/fused_elementwise.py --repeats 9 --out results/fused_elementwise.json

Alone: bench-qwen2's heads (4 query, 2 K/V, head_dim 64), MLP (intermediate 1,024) and hidden size (256)
over a packed prefill's 2,000 tokens and a decode step's 32 rows (the rotary in fp32 and bf16, the others
in fp32), the
two contenders interleaved, outputs checked bitwise. Rollouts: bench-qwen2 fp32, 32 prompts x 16 new
tokens, greedy, EOS off, on the ShareGPT-like mix, the spread and short similar prompts, with the default
and the invariant kernels; for each, calls with the fused kernels on and off alternate (ABBA) after a
warm-up, and their tokens must be equal. One thread. Medians, ratios (fused / eager), raw samples to JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's shared helpers: interleave.py, shared_decode.py

import torch
from interleave import interleaved

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.intercept import elementwise as fused_scope
from autobucket.engine.kernels.elementwise.gated_mlp import silu_and_mul
from autobucket.engine.kernels.elementwise.rms_norm import rms_norm
from autobucket.engine.kernels.elementwise.rotary import fused_rotary_embedding
from autobucket.engine.kernels.library import load_invariant_kernels
from autobucket.models import build_tiny_model
from autobucket.prompts import random_prompts
from autobucket.tools.workloads import reference_workloads, sharegpt_like_lengths

LLAMA_MODELING_MODULE = fused_scope.llama_modeling_module


def report(rows: list[dict], label: str, samples: dict, equal: bool, **fields) -> None:
    medians = {name: statistics.median(values) for name, values in samples.items()}
    rows.append({"operation": label, **fields, "bitwise_equal": equal, "medians_ms": medians, "samples_ms": samples})
    shape = " ".join(f"{key} {value}" for key, value in fields.items())
    print(f"alone {label} {shape}: eager {medians['eager']:.3f} ms, fused {medians['fused']:.3f} ms, "
          f"ratio {medians['fused'] / medians['eager']:.2f}; bitwise equal {equal}", flush=True)  # fmt: skip


def product_alone(repeats: int) -> list[dict]:
    rows: list[dict] = []
    for tokens in (2000, 32):
        generator = torch.Generator().manual_seed(0)
        gate, up = (torch.randn(tokens, 1024, generator=generator) for _ in range(2))
        equal = torch.equal(torch.nn.functional.silu(gate) * up, silu_and_mul(gate, up))
        samples = interleaved({"eager": lambda gate=gate, up=up: torch.nn.functional.silu(gate) * up,
                               "fused": lambda gate=gate, up=up: silu_and_mul(gate, up)}, repeats)  # fmt: skip
        report(rows, "silu_and_mul", samples, equal, dtype="float32", tokens=tokens)
    return rows


def norm_alone(repeats: int) -> list[dict]:
    model = build_tiny_model("bench-qwen2")
    norm = model.model.norm
    rows: list[dict] = []
    for tokens in (2000, 32):
        hidden = torch.randn(tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            equal = torch.equal(norm(hidden), rms_norm(hidden, norm.weight, norm.variance_epsilon))
            samples = interleaved({"eager": lambda hidden=hidden: norm(hidden),
                                   "fused": lambda hidden=hidden: rms_norm(hidden, norm.weight, norm.variance_epsilon)},
                                  repeats)  # fmt: skip
        report(rows, "rms_norm", samples, equal, dtype="float32", tokens=tokens)
    return rows


def rotary_alone(repeats: int) -> list[dict]:
    model = build_tiny_model("bench-qwen2")
    builtin = sys.modules[type(model).__module__].apply_rotary_pos_emb
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch, tokens in ((1, 2000), (32, 1)):
            generator = torch.Generator().manual_seed(0)
            q = torch.randn(batch, tokens, 4, 64, generator=generator).to(dtype).transpose(1, 2)
            k = torch.randn(batch, tokens, 2, 64, generator=generator).to(dtype).transpose(1, 2)
            cos, sin = (torch.randn(batch, tokens, 64, generator=generator).to(dtype) for _ in range(2))
            operands = (q, k, cos, sin)
            pairs = zip(builtin(*operands), fused_rotary_embedding(*operands), strict=True)
            equal = all(torch.equal(a, b) for a, b in pairs)
            samples = interleaved({"eager": lambda operands=operands: builtin(*operands),
                                   "fused": lambda operands=operands: fused_rotary_embedding(*operands)}, repeats)  # fmt: skip
            report(rows, "rotary", samples, equal, dtype=str(dtype).removeprefix("torch."), batch=batch, tokens=tokens)
    return rows


def fuse(fused: bool) -> None:
    """The fused kernels on or off for the calls that follow: off, the fused scope finds no Llama-family
    modeling module to route (the library keeps no switch for this; the benchmark patches its lookup)."""
    fused_scope.llama_modeling_module = LLAMA_MODELING_MODULE if fused else (lambda model: None)


def timed_call(rollout: Rollout, prompts, sampling, fused: bool) -> tuple[float, list[list[int]]]:
    fuse(fused)
    started = time.perf_counter()
    tokens = rollout.generate(prompts, sampling).tokens
    return (time.perf_counter() - started) * 1e3, tokens


def rollouts(repeats: int) -> list[dict]:
    model = build_tiny_model("bench-qwen2")
    sampling = SamplingConfig(max_new_tokens=16, continuous_batch_size=32, eos_token_id=[])
    workloads = {"ShareGPT-like": sharegpt_like_lengths(32, seed=0)}
    chosen = ("spread", "short similar")
    workloads.update({w.name: w.lengths for w in reference_workloads() if w.name.startswith(chosen)})
    rows = []
    for kernels in ("torch", "invariant"):
        rollout = Rollout(model, config=RolloutConfig(kernels=kernels))
        for name, lengths in workloads.items():
            prompts = random_prompts(lengths, model.config.vocab_size, seed=0)
            tokens = {flag: timed_call(rollout, prompts, sampling, flag)[1] for flag in (True, False)}  # warm-up
            samples: dict[bool, list[float]] = {True: [], False: []}
            for round_ in range(repeats):
                for flag in (True, False) if round_ % 2 == 0 else (False, True):
                    ms, got = timed_call(rollout, prompts, sampling, flag)
                    samples[flag].append(ms)
                    assert got == tokens[flag]
            fused, eager = statistics.median(samples[True]), statistics.median(samples[False])
            rows.append({"kernels": kernels, "workload": name, "tokens_equal": tokens[True] == tokens[False],
                         "medians_ms": {"fused": fused, "eager": eager}, "ratio": fused / eager,
                         "samples_ms": {"fused": samples[True], "eager": samples[False]}})  # fmt: skip
            print(f"rollout {kernels:9s} {name:28s}: fused {fused:.0f} ms, eager {eager:.0f} ms, ratio "
                  f"{fused / eager:.3f}; tokens equal {rows[-1]['tokens_equal']}", flush=True)  # fmt: skip
    fuse(True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="results/fused_elementwise.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_invariant_kernels()
    alone = rotary_alone(args.repeats * 5) + product_alone(args.repeats * 5) + norm_alone(args.repeats * 5)
    result = {"alone": alone, "rollouts": rollouts(args.repeats)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
