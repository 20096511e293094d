"""One rank of a 2-process DeepSpeed ZeRO-3 run (CPU accelerator, gloo), for test_zero3_rollout.py.

python zero3_worker.py RANK PORT OUT_JSON  (the control's tokens, if it finishes: OUT_JSON.control)

Each rank builds the same tiny Llama, wraps it in a ZeRO-3 engine (every parameter partitioned: no
persistence threshold), and asks `AutobucketRollout` for its own prompts (sharded_worker.rank_prompts:
uneven counts and budgets) on routes auto and ordinary, then one prompt and one new token on rank 0 (a
single forward) against rank 1's five prompts, then rank 1 asks for max_new_tokens=-1 while
rank 0 asks for its budget. It writes the tokens, the refusals and the engine's state before and after. Then
the negative control: the same generation without the gathering.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sharded_worker import MODEL, SEED, rank_prompts  # noqa: E402

EOS = 2
ENGINES: list = []  # the run's engine, for the control that follows it


def engine_state(engine) -> dict:
    module = engine.module
    return {
        "status": sorted({str(p.ds_status) for p in module.parameters()}),
        "local_numel": [p.numel() for p in module.parameters()],
        "hooks": [(name, len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in module.named_modules()],
        "ds_ids": [getattr(m, "ds_id", None) for m in module.modules()],
    }


def engine_logits(engine) -> list[float]:
    """A forward through ZeRO-3's hooks (per-submodule gathers, the same on both ranks)."""
    with torch.no_grad():
        return engine.module(torch.tensor([[5, 6, 7, 8]])).logits[0, -1, :8].tolist()


def request_for(prompts: list[list[int]]):
    from deepspeed.runtime.rollout import RolloutRequest

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return RolloutRequest(prompt_ids=ids, prompt_attention_mask=mask)


def run(rank: int) -> dict:
    import deepspeed
    from deepspeed.runtime.rollout import SamplingConfig

    from autobucket import CostCoefficients, RolloutConfig
    from autobucket.integrations.deepspeed import AutobucketRollout
    from autobucket.models import build_tiny_model

    model = build_tiny_model(MODEL, seed=SEED)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    ENGINES.append(engine)
    logits_before, before = engine_logits(engine), engine_state(engine)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=EOS)
    prompts, budget = rank_prompts(rank)
    out: dict = {"tokens": {}}
    for route in ("auto", "ordinary"):
        rollout = AutobucketRollout(engine, tokenizer, RolloutConfig(route=route, costs=CostCoefficients()))
        rollout.generate(request_for(prompts), SamplingConfig(max_new_tokens=budget, temperature=0.0))
        out["tokens"][route] = rollout.last_result.tokens
    # one forward on rank 0 (one prompt, one new token: the prefill) against many on rank 1
    one = [prompts[0]] if rank == 0 else prompts
    rollout.generate(request_for(one), SamplingConfig(max_new_tokens=1 if rank == 0 else budget, temperature=0.0))
    out["uneven"] = rollout.last_result.tokens
    try:  # rank 1 asks for a negative number of new tokens
        rollout.generate(request_for(prompts), SamplingConfig(max_new_tokens=-1 if rank == 1 else budget, temperature=0.0))
    except Exception as error:  # noqa: BLE001 - reported to the test, which checks type and text
        out["error"] = f"{type(error).__name__}: {error}"
    out["state_kept"] = engine_state(engine) == before
    out["logits_kept"] = engine_logits(engine) == logits_before
    return out


def control(rank: int, path: str) -> None:
    """The negative control, last (it breaks the process group): ZeRO-3's per-submodule gathers at every
    forward with uneven work; a rank that finishes writes its tokens to `path`."""
    from deepspeed.runtime.rollout import SamplingConfig

    from autobucket import CostCoefficients, RolloutConfig
    from autobucket.integrations import deepspeed as adapter
    from autobucket.integrations.deepspeed import AutobucketRollout

    adapter.gathered_zero3 = lambda engine: contextlib.nullcontext()
    engine = ENGINES[0]
    prompts, budget = rank_prompts(rank)
    rollout = AutobucketRollout(engine, SimpleNamespace(pad_token_id=0, eos_token_id=EOS),
                                RolloutConfig(route="bucketed", costs=CostCoefficients()))  # fmt: skip
    rollout.generate(request_for(prompts), SamplingConfig(max_new_tokens=budget, temperature=0.0))
    with open(path, "w") as file:
        json.dump(rollout.last_result.tokens, file)


def main() -> None:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, chain=True)
    rank, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_SIZE="2")  # fmt: skip
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = run(rank)
    with open(path, "w") as file:
        json.dump(out, file)
    control(rank, path + ".control")
    os._exit(0)  # no goodbye collective: a peer still inside the control's gathers fails at once


if __name__ == "__main__":
    main()
