"""One rank of a 2-process gloo run on a model sharded with FSDP2 (`fully_shard`), for test_sharded_models.py.

python sharded_worker.py SCENARIO RANK WORLD PORT OUT_JSON

Each rank builds the same tiny model, shards it, generates for its own prompts (`rank_prompts`) and writes
what the test compares (tokens, logprobs, the model's state before and after) to OUT_JSON. Scenarios:
- gathered: routes auto, ordinary and bucketed on a tiny Llama;
- peft: a LoRA PeftModel, sharded as accelerate shards one (the layers, then the PeftModel as root);
- per_layer: the negative control, the sharded forward's own per-layer all-gathers at every step;
- bad_input: rank 1's prompt holds a token id past the vocabulary;
- invariant: kernels="invariant", sampled; the trainer's sharded forward under autobucket.invariant;
- nested: one enclosing gather, inside it rank 0 makes one call and rank 1 five;
- all: the five above but per_layer, one after another in the same two processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys

import torch
import torch.distributed as dist

MODEL, SEED, VOCAB = "tiny-llama", 41, 1024


def rank_prompts(rank: int) -> tuple[list[list[int]], int]:
    """Uneven work: rank 0 has 3 short prompts and 4 new tokens, rank 1 five longer ones and 9."""
    rng = random.Random(100 + rank)
    lengths = [3, 7, 5] if rank == 0 else [11, 4, 17, 9, 6]
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths], (4 if rank == 0 else 9)


def build(scenario: str) -> torch.nn.Module:
    from autobucket.models import build_tiny_model

    model = build_tiny_model(MODEL, seed=SEED)
    if scenario == "peft":
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return model


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """The layers, then the root: what accelerate's FSDP2 and TRL do with a decoder-layer wrap policy."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if type(module).__name__ == "LlamaDecoderLayer":
            fully_shard(module)
    return fully_shard(model)


def model_state(model: torch.nn.Module) -> dict:
    """What the in-process contract keeps: parameter objects and types, shard values, hooks, FSDP flags."""
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state") for g in m._get_fsdp_state()._fsdp_param_groups]
    return {
        "parameters": [(name, id(p), type(p.data).__name__, p.to_local().sum().item() if hasattr(p, "to_local") else None)
                       for name, p in model.named_parameters()],  # fmt: skip
        "hooks": sorted((name, len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()),
        "sharded": [g.is_sharded for g in groups],
        "reshard_after_forward": [g.post_forward_mesh_info is not None for g in groups],
        "forward_indices": [len(g._post_forward_indices) for g in groups],
        "training": [m.training for m in model.modules()],
    }


def sharded_logits(model: torch.nn.Module, rank: int) -> list[float]:
    """A trainer's sharded forward (per-layer all-gathers, the same count on every rank)."""
    prompt = torch.tensor([rank_prompts(0)[0][0]])
    with torch.no_grad():
        return model(prompt).logits[0, -1, :8].tolist()


def generate_routes(model, rank: int, routes: tuple[str, ...]) -> dict:
    from autobucket import CostCoefficients, Rollout, RolloutConfig, SamplingConfig

    prompts, budget = rank_prompts(rank)
    sampling = SamplingConfig(max_new_tokens=budget, eos_token_id=[], continuous_batch_size=4)
    return {route: Rollout(model, config=RolloutConfig(route=route, costs=CostCoefficients()))
            .generate(prompts, sampling).tokens for route in routes}  # fmt: skip


def invariant_logprobs(model, rank: int) -> dict:
    """Sampled tokens and logprobs, and those of the trainer's sharded forward (one teacher-forced batch
    per rank: the same collectives on every rank) with and without autobucket.invariant."""
    from autobucket import CostCoefficients, Rollout, RolloutConfig, SamplingConfig

    prompts, budget = rank_prompts(rank)
    sampling = SamplingConfig(max_new_tokens=budget, eos_token_id=[], temperature=1.0, seed=5, logprobs=True)
    config = RolloutConfig(route="bucketed", kernels="invariant", costs=CostCoefficients())
    result = Rollout(model, config=config).generate(prompts, sampling)
    return {"tokens": result.tokens, "sampled": result.logprobs,
            "scoped": trainer_side(model, prompts, result.tokens, scoped=True),
            "unscoped": trainer_side(model, prompts, result.tokens, scoped=False)}  # fmt: skip


def trainer_side(model, prompts: list[list[int]], completions: list[list[int]], scoped: bool) -> list[list[float]]:
    """Per row, its completion's logprobs as a trainer scores them: left-padded prompts + right-padded
    completions in one forward, TRL's formula."""
    import autobucket
    from autobucket.engine.batching.prefill import positions_from_mask
    from autobucket.engine.trainer_logprobs import teacher_forced_batch, trainer_logprobs

    ids, mask, width = teacher_forced_batch(prompts, completions)
    with torch.no_grad(), autobucket.invariant(model) if scoped else contextlib.nullcontext():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    values = trainer_logprobs(logits[:, width - 1 : -1], ids[:, width:])
    return [values[row, : len(tokens)].tolist() for row, tokens in enumerate(completions)]


@contextlib.contextmanager
def per_layer_collectives():
    """The negative control: no gathering, so every forward all-gathers each layer's shards."""
    from autobucket.engine import rollout

    original = rollout.is_sharded
    rollout.is_sharded = lambda model: False
    try:
        yield
    finally:
        rollout.is_sharded = original


SCENARIOS = ("gathered", "peft", "bad_input", "invariant", "nested")  # "all" runs these in one pair of processes


def weight_bytes(model: torch.nn.Module) -> dict:
    """Parameter bytes this rank holds: its shards, and all of them inside a call's gathering."""
    from autobucket.engine.model_access.sharded_weights import gathered_weights

    def held() -> int:
        return sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())

    sharded = held()
    with gathered_weights(model):
        gathered = held()
    return {"sharded": sharded, "gathered": gathered}


def run(scenario: str, rank: int) -> dict:
    model = shard(build(scenario))
    logits_before = sharded_logits(model, rank)  # FSDP's lazy initialisation happens at the first forward
    before = model_state(model)
    out: dict = {}
    if scenario in ("gathered", "peft"):
        routes = ("auto", "ordinary", "bucketed") if scenario == "gathered" else ("auto", "ordinary")
        out["tokens"] = generate_routes(model, rank, routes)
        out["bytes"] = weight_bytes(model)
    elif scenario == "per_layer":
        with per_layer_collectives():
            out["tokens"] = generate_routes(model, rank, ("bucketed",))
    elif scenario == "bad_input":
        out["error"] = refusal(model, rank)
    elif scenario == "nested":
        out["tokens"] = nested_calls(model, rank)
    elif scenario == "invariant":  # its trainer forwards are FSDP's record too: the state is not compared
        out.update(invariant_logprobs(model, rank))
    out["state_kept"] = model_state(model) == before
    out["logits_kept"] = sharded_logits(model, rank) == logits_before  # also: the ranks are still in step
    return out


def nested_calls(model, rank: int) -> list[list[int]]:
    """Different numbers of calls per rank on one enclosing gather (as the TRL adapter makes one call per
    distinct run length): rank 0 one call for all its prompts, rank 1 one call per prompt."""
    from autobucket import CostCoefficients, Rollout, RolloutConfig, SamplingConfig
    from autobucket.engine.model_access.sharded_weights import gathered_weights

    prompts, budget = rank_prompts(rank)
    rollout = Rollout(model, config=RolloutConfig(route="auto", costs=CostCoefficients()))
    sampling = SamplingConfig(max_new_tokens=budget, eos_token_id=[])
    with gathered_weights(model):
        if rank == 0:
            return rollout.generate(prompts, sampling).tokens
        return [rollout.generate([prompt], sampling).tokens[0] for prompt in prompts]


def refusal(model, rank: int) -> str | None:
    """What generate raised on this rank when rank 1's prompt holds an id past the vocabulary."""
    from autobucket import Rollout, SamplingConfig

    prompts = [[5, 6, VOCAB + 3]] if rank == 1 else rank_prompts(rank)[0]
    try:
        Rollout(model).generate(prompts, SamplingConfig(max_new_tokens=3))
    except Exception as error:  # noqa: BLE001 - reported to the test, which checks type and text
        return f"{type(error).__name__}: {error}"
    return None


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
