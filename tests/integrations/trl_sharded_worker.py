"""One rank of TRL's GRPO trainer on a model sharded over 2 CPU processes, for test_trl_sharded.py.

accelerate launch --num_processes 2 (--use_deepspeed ... | --use_fsdp --fsdp_version 2 ...) \
    trl_sharded_worker.py BACKEND OUT_DIR SCENARIO[,SCENARIO...]

BACKEND is "zero3" (accelerate's DeepSpeed plugin, ZeRO stage 3, every parameter partitioned) or "fsdp2"
(accelerate's FSDP plugin, version 2: `fully_shard` on each decoder layer and the root). Each rank runs the
scenarios one after another in the same process group and writes OUT_DIR/rank{R}.json. Scenarios:
- stock: the stock `GRPOTrainer` (TRL's own generation), greedy;
- greedy: `AutobucketGRPOTrainer`, greedy, route auto;
- invariant: `AutobucketGRPOTrainer` sampling with kernels="invariant" (TRL's logged mismatch metrics);
- default_kernels: the same sampling run on the default kernels (the control: a non-zero mismatch);
- bad_input: rank 1's dataset prompt does not fit the model's context with the completion budget (refused
  by the adapter's checks);
- bad_token: rank 1's prompt holds a token id past the model's vocabulary (refused inside `Rollout.generate`);
- unshared: the negative control, bad_token with the refusal not shared between ranks (last: it breaks the
  process group; rank 1 exits after its refusal, rank 0 goes on to the training step's collectives).
Each scenario's result is written as soon as it ends, so a control that hangs until the test's timeout
keeps the others'.

FSDP2 on CPUs: accelerate's `AcceleratorState` turns FSDP on only from a `MULTI_<accelerator>` distributed
type (`accelerate/state.py`, `AcceleratorState.__init__`: `elif self.distributed_type in [MULTI_GPU, MULTI_MLU,
..., MULTI_NEURON]`), and `PartialState._prepare_backend` gives `MULTI_CPU` with `use_cpu=True` and `NO` on a
machine without an accelerator. `fsdp2_on_cpu` marks the process group (gloo, 2 processes) as `MULTI_GPU` for
that one test, so `AcceleratorState` takes the FSDP plugin; everything after it (accelerate's
`fsdp2_prepare_model`, `fully_shard`, the gloo collectives, the optimizer) runs as it would on a GPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from test_integration_trl import prompt_texts, word_tokenizer  # noqa: E402

MODEL, NUM_GENERATIONS, MAX_COMPLETION = "tiny-qwen2", 2, 8
PROMPT_WORDS = (300, 4, 7, 3)  # rows per rank: 2 prompts x 2 generations, uneven prompt lengths
CONTEXT = 2048  # tiny-qwen2's positions
OUTSIDE_WORD = "w1024"


def firing_eos() -> int:
    """A token that ends some prompt's greedy completion before its last position and never occurs in
    others' (workloads' rule), so EOS masking is exercised and some completions run to the budget; the
    same on every rank."""
    from workloads import firing_eos_candidates

    from autobucket.models import build_tiny_model

    model, tokenizer = build_tiny_model(MODEL), word_tokenizer(2)
    outputs = []
    for text in prompt_texts(PROMPT_WORDS):
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_COMPLETION, do_sample=False)
        outputs.append(out[0, ids.shape[1] :].tolist())
    early = [t for t in firing_eos_candidates(outputs) if any(t in tokens[:-1] for tokens in outputs)]
    assert early, "no token ends some greedy completions early but not all: change the prompts"
    return early[0]


def texts_for(scenario: str) -> list[str]:
    """The dataset; its last prompt is rank 1's (TRL's sampler deals prompts to ranks in order)."""
    if scenario == "bad_input":  # 2045 words + 8 new tokens pass the context: refused before generating
        return prompt_texts((*PROMPT_WORDS[:3], CONTEXT - 3))
    texts = prompt_texts(PROMPT_WORDS)
    if scenario in ("bad_token", "unshared"):  # a word the tokenizer has, the model not: refused while generating
        texts[-1] += f" {OUTSIDE_WORD}"
    return texts


def tokenizer_for(scenario: str, eos: int):
    tokenizer = word_tokenizer(eos)
    if scenario in ("bad_token", "unshared"):
        tokenizer.add_tokens([OUTSIDE_WORD])  # id 1024, one past the tiny model's vocabulary
    return tokenizer


def grpo_config(out_dir: Path, scenario: str):
    from trl import GRPOConfig

    settings = dict(
        output_dir=str(out_dir / scenario), per_device_train_batch_size=NUM_GENERATIONS * 2,
        num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION, max_steps=2, learning_rate=0.05,
        logging_steps=1, report_to="none", bf16=False, save_strategy="no", seed=0, shuffle_dataset=False,
        temperature=1.0, top_k=0, top_p=1.0, dataloader_num_workers=0, ddp_backend="gloo",
    )  # fmt: skip
    if scenario not in ("invariant", "default_kernels"):  # identical samples: the entropy bonus moves the weights
        settings.update(generation_kwargs={"do_sample": False}, entropy_coef=0.5)
    return GRPOConfig(**settings)


def fsdp2_on_cpu(args) -> None:
    """Let accelerate's AcceleratorState take the FSDP plugin on a CPU process group (see the docstring)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    assert args.device.type == "cpu"  # builds the PartialState: gloo, the launcher's 2 processes
    state = PartialState()
    assert state.num_processes == 2 and state.distributed_type == DistributedType.NO, state
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def trainer_for(backend: str, scenario: str, out_dir: Path, eos: int, completions: list):
    from datasets import Dataset
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    from trl import GRPOTrainer

    from autobucket import RolloutConfig
    from autobucket.integrations.trl import AutobucketGRPOTrainer
    from autobucket.models import build_tiny_model

    unset_hf_deepspeed_config()  # the last trainer's ZeRO-3 config would build the next model under zero.Init
    model = build_tiny_model(MODEL)  # before this trainer's config, for the same reason
    args = grpo_config(out_dir, scenario)
    if backend == "fsdp2":
        fsdp2_on_cpu(args)

    def toy_reward(completion_ids, **kwargs):  # also records what TRL scored, in TRL's row order
        completions.append([list(ids) for ids in completion_ids])
        return [float(len(set(ids)) + sum(ids) % 5) for ids in completion_ids]

    common = dict(model=model, reward_funcs=toy_reward, args=args, processing_class=tokenizer_for(scenario, eos),
                  train_dataset=Dataset.from_dict({"prompt": texts_for(scenario)}))  # fmt: skip
    if scenario == "stock":
        return GRPOTrainer(**common)
    kernels = {"invariant": "invariant", "default_kernels": "auto"}.get(scenario, "auto")
    return AutobucketGRPOTrainer(**common, rollout_config=RolloutConfig(route="auto", kernels=kernels))


def sharding(trainer) -> dict:
    """How the trainer's parameters are held on this rank: partitioned (ZeRO-3: no local elements; FSDP2:
    DTensor shards smaller than the whole) or not, and the distributed type accelerate chose."""
    params = list(trainer.model_wrapped.parameters())
    partitioned = sum(
        (hasattr(p, "ds_numel") and p.numel() < p.ds_numel)
        or (hasattr(p, "to_local") and p.to_local().numel() < p.numel())
        for p in params
    )
    return {"parameters": len(params), "partitioned": int(partitioned),
            "distributed_type": str(trainer.accelerator.distributed_type)}  # fmt: skip


def weight_digests(trainer, backend: str) -> dict[str, str]:
    """sha256 of each full parameter's bytes (gathered: the same collectives, in order, on every rank)."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    named = list(model.named_parameters())
    if backend == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {name: digest(p.data) for name, p in named}
    return {name: digest(p.full_tensor() if hasattr(p, "full_tensor") else p.data) for name, p in named}


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


def run(backend: str, scenario: str, out_dir: Path, eos: int) -> dict:
    if scenario == "unshared":
        import contextlib

        from autobucket.integrations import trl_generation

        trl_generation.failures_shared = lambda active: contextlib.nullcontext()
    completions: list = []
    trainer = trainer_for(backend, scenario, out_dir, eos, completions)
    out: dict = {}
    try:
        trainer.train()
    except Exception as error:  # noqa: BLE001 - reported to the test, which checks type and text
        out["error"] = f"{type(error).__name__}: {error}"
    out.update(
        completions=completions, sharding=sharding(trainer), routes=getattr(trainer, "autobucket_routes", None),
        mismatch=[(h["mismatch/k3"], h["mismatch/max_abs_logp_diff"]) for h in trainer.state.log_history
                  if "mismatch/k3" in h],
    )  # fmt: skip
    if "error" not in out:
        out["weights"] = weight_digests(trainer, backend)
    return out


def main() -> None:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, chain=True)  # a rank the test stops (a hang) prints where it waited
    backend, out_dir, scenarios = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    torch.set_num_threads(1)
    results: dict = {"eos": firing_eos()}
    path = out_dir / f"rank{os.environ['RANK']}.json"
    for scenario in scenarios:
        results[scenario] = run(backend, scenario, out_dir, results["eos"])
        path.write_text(json.dumps(results))
    os._exit(0)  # no goodbye collective: after the control, a peer may still wait in the training step


if __name__ == "__main__":
    main()
