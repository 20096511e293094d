"""One rank of a 2-process DeepSpeed ZeRO-3 run (CPU accelerator, gloo) of `sharded_weights="lockstep"`, for
test_sharded_lockstep.py.

python zero3_lockstep_worker.py SCENARIO RANK WORLD PORT OUT_JSON

Each rank builds the same tiny Llama, wraps it in a ZeRO-3 engine (every parameter partitioned: no
persistence threshold) and hands `engine.module` to `Rollout` with lockstep, for its own prompts
(sharded_worker.rank_prompts: uneven counts and budgets). Scenarios:
- all: routes auto, ordinary and bucketed; rank 0 on ordinary and rank 1 on bucketed in one call; rank 0
  with no prompts; rank 1 refusing its input; kernels="invariant" against the trainer's forward under
  autobucket.invariant; the engine's state before and after;
- unpaired: the negative control, the protocol off (ZeRO-3's per-submodule gathers unpaired).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lockstep_worker import counted_collectives, protocol_off  # noqa: E402
from sharded_worker import MODEL, SEED, VOCAB, rank_prompts, trainer_side  # noqa: E402
from zero3_worker import engine_logits, engine_state  # noqa: E402


def zero3_engine():
    import deepspeed

    from autobucket.models import build_tiny_model

    model = build_tiny_model(MODEL, seed=SEED)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    return engine


def generate(module, rank: int, route: str, prompts=None) -> dict:
    from autobucket import CostCoefficients, Rollout, RolloutConfig, SamplingConfig

    own, budget = rank_prompts(rank)
    config = RolloutConfig(route=route, sharded_weights="lockstep", costs=CostCoefficients(), kernels="torch")
    sampling = SamplingConfig(max_new_tokens=budget, eos_token_id=[], continuous_batch_size=4)
    with counted_collectives() as counts:
        result = Rollout(module, config=config).generate(own if prompts is None else prompts, sampling)
    return {"tokens": result.tokens, "route": result.profile.route, "protocols": counts["protocols"]}


def invariant_logprobs(module, rank: int) -> dict:
    """Sampled logprobs under kernels="invariant" on the partitions, and the trainer's forward through
    ZeRO-3's hooks with and without autobucket.invariant."""
    from autobucket import CostCoefficients, Rollout, RolloutConfig, SamplingConfig

    prompts, budget = rank_prompts(rank)
    config = RolloutConfig(route="bucketed", sharded_weights="lockstep", kernels="invariant", costs=CostCoefficients())
    sampling = SamplingConfig(max_new_tokens=budget, eos_token_id=[], temperature=1.0, seed=5, logprobs=True)
    result = Rollout(module, config=config).generate(prompts, sampling)
    return {"sampled": result.logprobs, "packed_weight_bytes": result.profile.packed_weight_bytes,
            "scoped": trainer_side(module, prompts, result.tokens, scoped=True),
            "unscoped": trainer_side(module, prompts, result.tokens, scoped=False)}  # fmt: skip


def refusal(module, rank: int) -> str | None:
    from autobucket import CostCoefficients, Rollout, RolloutConfig, SamplingConfig

    prompts = [[5, 6, VOCAB + 3]] if rank == 1 else rank_prompts(rank)[0]
    config = RolloutConfig(sharded_weights="lockstep", costs=CostCoefficients(), kernels="torch")
    try:
        Rollout(module, config=config).generate(prompts, SamplingConfig(max_new_tokens=3, eos_token_id=[]))
    except Exception as error:  # noqa: BLE001 - reported to the test, which checks type and text
        return f"{type(error).__name__}: {error}"
    return None


def run(scenario: str, rank: int) -> dict:
    engine = zero3_engine()
    module = engine.module
    logits_before, before = engine_logits(engine), engine_state(engine)
    out: dict = {}
    if scenario == "unpaired":
        with protocol_off():
            out["unpaired"] = generate(module, rank, "bucketed")
    else:
        out["routes"] = {route: generate(module, rank, route) for route in ("auto", "ordinary", "bucketed")}
        out["mixed"] = generate(module, rank, "ordinary" if rank == 0 else "bucketed")
        out["empty"] = generate(module, rank, "auto", prompts=[] if rank == 0 else None)
        out["bad_input"] = refusal(module, rank)
        out["invariant"] = invariant_logprobs(module, rank)
    out["state_kept"] = engine_state(engine) == before
    out["logits_kept"] = engine_logits(engine) == logits_before  # also: the ranks are still in step
    return out


def main() -> None:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, chain=True)
    scenario, rank, world, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                      WORLD_SIZE=world, LOCAL_RANK=str(rank), LOCAL_SIZE=world)  # fmt: skip
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = run(scenario, rank)
    with open(path, "w") as file:
        json.dump(out, file)
    with contextlib.suppress(Exception):
        torch.distributed.barrier()
    os._exit(0)  # no goodbye collective beyond the barrier: a control's peer may be gone


if __name__ == "__main__":
    main()
