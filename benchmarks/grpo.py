"""GRPO-like sampling: 16 prompts of mixed lengths x n = 8 samples, temperature 1.0, 32 new tokens.

    python benchmarks/grpo.py --repeats 3 --out results/grpo.json

Contenders on the 20.3M Qwen2 (`bench-qwen2`, fp32, CPU):
- autobucket auto (coefficients from --costs, else defaults), n = 8 with one shared prefill per prompt;
- HF `generate(do_sample=True, num_return_sequences=8)` on the left-padded batch (the usual RL path);
- HF `generate_batch` with num_return_sequences = 8 (transformers 5.x).
Sampled tokens differ between HF and autobucket (different random streams), so this compares time and
prefill work, not tokens; autobucket's own route invariance is tested in tests/engine/sampling/test_sampling.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.batching.prefill import left_pad
from autobucket.models import build_tiny_model
from autobucket.prompts import random_prompts
from autobucket.tools.baselines import has_generate_batch

LENGTHS = (512, 384, 256, 192, 128, 96, 64, 64, 48, 32, 32, 24, 16, 16, 12, 8)
SAMPLES, NEW_TOKENS = 8, 32


def autobucket_contender(model, costs):
    rollout = Rollout(model, config=RolloutConfig(route="auto", costs=costs))
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, continuous_batch_size=128, temperature=1.0, n=SAMPLES, seed=0)

    def run(prompts):
        profile = rollout.generate(prompts, sampling).profile
        return {"prefill_tokens": profile.prefill_tokens, "route": profile.route, "groups": profile.prefill_groups}

    return run


def hf_generate_contender(model):
    def run(prompts):
        input_ids, attention_mask = left_pad(prompts, 0, torch.device("cpu"))
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, num_return_sequences=SAMPLES, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                pad_token_id=0,
            )
        return {"prefill_tokens": SAMPLES * input_ids.numel()}

    return run


def hf_generate_batch_contender(model):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.temperature, config.top_k, config.top_p = True, 1.0, 0, 1.0
    config.max_new_tokens, config.num_return_sequences, config.eos_token_id = NEW_TOKENS, SAMPLES, None
    sizing = ContinuousBatchingConfig(num_blocks=256, page_size=64, max_batch_tokens=1024, use_cuda_graph=False)

    def run(prompts):
        with torch.inference_mode():
            model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=sizing)
        return {"prefill_tokens": SAMPLES * sum(len(p) for p in prompts)}

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--costs", help="calibration / coefficients JSON for auto")
    parser.add_argument("--threads", type=int, help="torch threads (match the calibration's)")
    parser.add_argument("--out", default="results/grpo.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_tiny_model("bench-qwen2")
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=0)
    contenders = {"autobucket auto (n=8)": autobucket_contender(model, args.costs),
                  "HF generate (num_return_sequences=8)": hf_generate_contender(model)}
    if has_generate_batch(model):
        contenders["HF generate_batch (num_return_sequences=8)"] = hf_generate_batch_contender(model)
    samples = {name: [] for name in contenders}
    info = {}
    for repeat in range(args.repeats + 1):
        for name, run in contenders.items():
            started = time.perf_counter()
            info[name] = run(prompts)
            if repeat:  # round 0 is the warm-up
                samples[name].append((time.perf_counter() - started) * 1e3)
    ours = statistics.median(samples["autobucket auto (n=8)"])
    print(f"unique prompt tokens: {sum(LENGTHS)}; rows: {len(LENGTHS) * SAMPLES}; new tokens/row: {NEW_TOKENS}")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"{name:44s} {median:9.1f} ms  prefill tokens {info[name]['prefill_tokens']:6d}  "
              f"autobucket/this {ours / median:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"samples_ms": samples, "info": info, "lengths": LENGTHS}, indent=1, default=str))


if __name__ == "__main__":
    main()
