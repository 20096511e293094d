"""TRL GRPO with num_iterations=2: step time with the old-policy forward skipped (sampling logprobs reused).

    quiet-run -- taskset -c 0 .venv/bin/python benchmarks/studies/trl_old_logps.py --out results/trl_old_logps.json

With `num_iterations > 1` (or `steps_per_generation > gradient_accumulation_steps`) TRL runs one no-grad
forward over every generation batch only to get `old_per_token_logps`. `AutobucketGRPOTrainer` with
`RolloutConfig(kernels="invariant")` reuses the sampling logprobs instead (bitwise the same,
tests/integrations/test_integration_trl.py); `reuse_sampling_logps=False` keeps TRL's forward. Both arms train the same
model (`bench-qwen2` by default, fp32, CPU) from the same weights on the same prompts and seed, so they
sample the same completions; runs alternate (on, off, on, off, ...) after `--warmup` discarded runs per arm. Reported per arm: the median over
runs of the mean time of the steps that generate (where the forward is skipped), of the other steps, and of
the whole `train()`, the time in the old-policy logprob calls (TRL's forward, or the reuse), the number
of skipped forwards, and whether the final weights equal the other arm's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig

from autobucket import RolloutConfig
from autobucket.integrations.trl import AutobucketGRPOTrainer
from autobucket.models import build_tiny_model


def word_tokenizer(vocab_size: int):
    """Word-level tokenizer over the model's vocabulary: id i <-> "w{i}" (pad 0, bos 1, eos 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


class TimedTrainer(AutobucketGRPOTrainer):
    """Times the no-grad per-token-logprob calls (the old-policy forward, or its reuse)."""

    old_logps_s = 0.0

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        start = time.perf_counter()
        try:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        finally:
            self.old_logps_s += time.perf_counter() - start


def train_once(args, reuse: bool, initial: dict, prompts: list[str], tokenizer) -> dict:
    model = build_tiny_model(args.model)
    model.load_state_dict(initial)
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=len(prompts) * args.num_generations,
            num_generations=args.num_generations, max_completion_length=args.new_tokens, max_steps=args.steps,
            num_iterations=args.num_iterations, learning_rate=1e-4, logging_steps=1, report_to="none", use_cpu=True,
            bf16=False, save_strategy="no", seed=0, shuffle_dataset=False, temperature=1.0, top_k=0, top_p=1.0,
            dataloader_num_workers=0, disable_dropout=True, disable_tqdm=True, log_level="error",
        )  # fmt: skip
        trainer = TimedTrainer(
            model=model, reward_funcs=lambda completion_ids, **kw: [float(sum(c) % 7) for c in completion_ids],
            args=config, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
            rollout_config=RolloutConfig(route="auto", kernels="invariant"), reuse_sampling_logps=reuse,
            callbacks=[timer],
        )
        start = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - start
    generating = [t for step, t in enumerate(timer.times) if step % args.num_iterations == 0]
    others = [t for step, t in enumerate(timer.times) if step % args.num_iterations != 0]
    return {
        "train_s": total, "generating_step_s": statistics.mean(generating),
        "other_step_s": statistics.mean(others) if others else None,
        "skipped_forwards": trainer.autobucket_old_logps_reused, "old_logps_s": trainer.old_logps_s,
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-qwen2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=128, help="longest prompt; others are shorter")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--num-iterations", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs per arm, interleaved")
    parser.add_argument("--warmup", type=int, default=1, help="discarded runs per arm first")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/trl_old_logps.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = build_tiny_model(args.model)
    vocab = model.config.vocab_size
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng = random.Random(7)
    lengths = [max(4, args.prompt_words * (i + 1) // args.prompts) for i in range(args.prompts)]
    prompts = [" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(n)) for n in lengths]
    tokenizer = word_tokenizer(vocab)

    runs: dict[str, list[dict]] = {"reuse": [], "trl_forward": []}
    for _ in range(args.warmup):  # first-call costs (kernel packs, allocator) out of the measured runs
        for reuse in (True, False):
            train_once(args, reuse, initial, prompts, tokenizer)
    for _ in range(args.repeats):
        for arm, reuse in (("reuse", True), ("trl_forward", False)):
            runs[arm].append(train_once(args, reuse, initial, prompts, tokenizer))
    same_weights = all(
        torch.equal(a["weights"][k], b["weights"][k])
        for a, b in zip(runs["reuse"], runs["trl_forward"], strict=True) for k in a["weights"]
    )  # fmt: skip
    report = {"settings": vars(args), "params": sum(v.numel() for v in initial.values()), "same_weights": same_weights}
    for arm, results in runs.items():
        report[arm] = {
            key: (statistics.median(r[key] for r in results) if results[0][key] is not None else None)
            for key in ("train_s", "generating_step_s", "other_step_s", "old_logps_s", "skipped_forwards")
        }
    on, off = report["reuse"], report["trl_forward"]
    report["generating_step_saved_s"] = off["generating_step_s"] - on["generating_step_s"]
    report["train_saved_fraction"] = 1.0 - on["train_s"] / off["train_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
