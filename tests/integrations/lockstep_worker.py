"""One rank of a 2-process gloo run of `sharded_weights="lockstep"` on a model sharded with FSDP2, for
test_sharded_lockstep.py.

python lockstep_worker.py SCENARIO RANK WORLD PORT OUT_JSON

Each rank builds the same tiny Llama (sharded_worker.build / shard), generates for its own prompts
(sharded_worker.rank_prompts: uneven counts and budgets) with each rank keeping only its shards, and writes
what the test compares to OUT_JSON. Scenarios:
- routes: routes auto, ordinary and bucketed, both ranks the same route per call;
- mixed: rank 0 on route ordinary (HF generate), rank 1 on bucketed, in one call;
- empty: rank 0 with no prompts, rank 1 with its own;
- invariant: kernels="invariant", sampled; the trainer's sharded forward under autobucket.invariant;
- bad_input: rank 1's prompt holds a token id past the vocabulary;
- failing: rank 1's logits processor raises at its third call, mid-generation;
- peft: a LoRA PeftModel, sharded as accelerate shards one (the layers, then the PeftModel as root);
- unpaired: the negative control, the lockstep protocol off (each rank's forwards unpaired);
- all: every scenario but unpaired, one after another in the same two processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sharded_worker import VOCAB, build, model_state, rank_prompts, shard, sharded_logits, trainer_side  # noqa: E402

SCENARIOS = ("routes", "mixed", "empty", "invariant", "bad_input", "failing", "peft")


@contextlib.contextmanager
def counted_collectives():
    """Counts of this rank's all-reduces (the protocol's exchanges) and all-gathers (FSDP's) while inside,
    and the protocol of each lockstep call (its forwards, one-token forwards and exchanges)."""
    from autobucket.engine import rollout

    counts = {"all_reduce": 0, "all_gather": 0, "protocols": []}
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"  # FSDP2's
    originals = (dist.all_reduce, getattr(dist, gather), rollout.lockstep_forwards)

    def all_reduce(*args, **kwargs):
        counts["all_reduce"] += 1
        return originals[0](*args, **kwargs)

    def all_gather(*args, **kwargs):
        counts["all_gather"] += 1
        return originals[1](*args, **kwargs)

    @contextlib.contextmanager
    def recorded(*args, **kwargs):
        with originals[2](*args, **kwargs) as protocol:
            if protocol is not None:  # None: the control's protocol, switched off
                counts["protocols"].append(protocol)
            yield protocol

    dist.all_reduce, rollout.lockstep_forwards = all_reduce, recorded
    setattr(dist, gather, all_gather)
    try:
        yield counts
    finally:
        dist.all_reduce, _, rollout.lockstep_forwards = originals
        setattr(dist, gather, originals[1])
        counts["protocols"] = [
            {"forwards": p.forwards, "dummy_forwards": p.dummy_forwards, "exchanges": p.exchanges} for p in counts["protocols"]
        ]


def lockstep(route: str, kernels: str = "torch"):
    from autobucket import CostCoefficients, RolloutConfig

    return RolloutConfig(route=route, sharded_weights="lockstep", costs=CostCoefficients(), kernels=kernels)


def generate(model, rank: int, route: str, prompts=None) -> dict:
    from autobucket import Rollout, SamplingConfig

    own, budget = rank_prompts(rank)
    prompts = own if prompts is None else prompts
    sampling = SamplingConfig(max_new_tokens=budget, eos_token_id=[], continuous_batch_size=4)
    with counted_collectives() as counts, most_bytes_held(model) as held:
        result = Rollout(model, config=lockstep(route)).generate(prompts, sampling)
    plan = result.profile.plan or {}
    return {"tokens": result.tokens, "route": result.profile.route, "decode_step": plan.get("decode_step"),
            "counts": counts, "most_held": held[0]}  # fmt: skip


@contextlib.contextmanager
def most_bytes_held(model):
    """[the most parameter bytes this rank held inside any decoder layer's forward while inside]: a layer's
    forward is where FSDP holds that layer's full weights."""
    most = [0]

    def record(module, args):
        most[0] = max(most[0], held_bytes(model))

    layers = [m for m in model.modules() if type(m).__name__.endswith("LlamaDecoderLayer")]
    handles = [layer.register_forward_pre_hook(record) for layer in layers]
    try:
        yield most
    finally:
        for handle in handles:
            handle.remove()


def invariant_logprobs(model, rank: int) -> dict:
    """Sampled tokens and logprobs under kernels="invariant" on the shards, and those of the trainer's
    sharded forward with and without autobucket.invariant."""
    from autobucket import Rollout, SamplingConfig

    prompts, budget = rank_prompts(rank)
    sampling = SamplingConfig(max_new_tokens=budget, eos_token_id=[], temperature=1.0, seed=5, logprobs=True)
    result = Rollout(model, config=lockstep("bucketed", kernels="invariant")).generate(prompts, sampling)
    return {"tokens": result.tokens, "sampled": result.logprobs, "kernels": result.profile.kernels,
            "packed_weight_bytes": result.profile.packed_weight_bytes,
            "scoped": trainer_side(model, prompts, result.tokens, scoped=True),
            "unscoped": trainer_side(model, prompts, result.tokens, scoped=False)}  # fmt: skip


def failure(model, rank: int, scenario: str) -> str | None:
    """What generate raised on this rank: rank 1 refuses its input (bad_input) or fails mid-call (failing)."""
    from autobucket import Rollout, SamplingConfig

    prompts, budget = rank_prompts(rank)
    overrides = {}
    if rank == 1 and scenario == "bad_input":
        prompts = [[5, 6, VOCAB + 3]]
    if rank == 1 and scenario == "failing":
        overrides["logits_processor"] = [FailsAtThirdCall()]
    try:
        Rollout(model, config=lockstep("auto")).generate(prompts, SamplingConfig(max_new_tokens=budget, eos_token_id=[]), **overrides)
    except Exception as error:  # noqa: BLE001 - reported to the test, which checks type and text
        return f"{type(error).__name__}: {error}"
    return None


class FailsAtThirdCall:
    """A logits processor that raises at its third call: a failure between two of the rank's forwards."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 3:
            raise ValueError("the reward shaper's processor failed at step 3")
        return scores


@contextlib.contextmanager
def protocol_off():
    """The negative control: lockstep's sharded forwards with the protocol off, so each rank runs its own
    number of forwards and their all-gathers go unpaired."""
    from autobucket.engine import rollout

    original = rollout.lockstep_forwards
    rollout.lockstep_forwards = lambda model, dummy_forward: contextlib.nullcontext()
    try:
        yield
    finally:
        rollout.lockstep_forwards = original


def held_bytes(model) -> int:
    return sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())


def run(scenario: str, rank: int) -> dict:
    model = shard(build("peft" if scenario == "peft" else "gathered"))
    logits_before = sharded_logits(model, rank)  # FSDP's lazy initialisation happens at the first forward
    if scenario == "peft":  # the root's shards only, as after a training step: the call must gather them
        model.reshard()
    before = model_state(model)
    out: dict = {}
    if scenario == "routes":
        out["routes"] = {route: generate(model, rank, route) for route in ("auto", "ordinary", "bucketed")}
    elif scenario == "mixed":
        out.update(generate(model, rank, "ordinary" if rank == 0 else "bucketed"))
    elif scenario == "empty":
        out.update(generate(model, rank, "auto", prompts=[] if rank == 0 else None))
    elif scenario == "invariant":  # its trainer forwards are FSDP's record too: the state is not compared
        out.update(invariant_logprobs(model, rank))
    elif scenario in ("bad_input", "failing"):
        out["error"] = failure(model, rank, scenario)
    elif scenario == "peft":
        out.update(generate(model, rank, "auto"))
    elif scenario == "unpaired":
        with protocol_off():
            out.update(generate(model, rank, "bucketed"))
    out["state_kept"] = model_state(model) == before
    out["logits_kept"] = sharded_logits(model, rank) == logits_before  # also: the ranks are still in step
    out["bytes"] = {"held": held_bytes(model), "full": sum(p.nbytes for p in build("gathered").parameters())}
    return out


def main() -> None:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, chain=True)  # a rank the test stops (a hang) prints where it waited
    scenario, rank, world, port, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = {name: run(name, rank) for name in (SCENARIOS if scenario == "all" else (scenario,))}
    finally:
        dist.destroy_process_group()
    with open(path, "w") as file:
        json.dump(out, file)


if __name__ == "__main__":
    main()
