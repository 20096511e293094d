"""A model sharded over 2 ranks with FSDP2 (CPU, gloo): `sharded_weights="gathered"` vs `"lockstep"` vs the
same model unsharded, on the same prompts per rank.

    python benchmarks/sharded_modes.py --repeats 5 --out results/sharded_modes.json
    python benchmarks/sharded_modes.py --model tiny-llama --prompts 2 --new-tokens 2 --repeats 1   # smoke

Model: a `TINY_CONFIGS` model by name (`bench-qwen2` by default: random weights, fp32), sharded as
accelerate's FSDP2 does (`fully_shard` on each decoder layer, then the root). Workload: rank r gets
--prompts + r * --extra-prompts prompts of 16 to 128 tokens and --new-tokens + r * --extra-tokens new
tokens (uneven work, as trainers' ranks have), greedy, no EOS, route "auto", --kernels (the default "auto"),
one thread per rank.
Contenders, interleaved after one warm-up each, every rank calling together (a barrier before each call):
the model unsharded (no collectives: the floor), gathered (one all-gather of the weights per call, then no
collectives), lockstep (each rank keeps its shards; per forward one all-reduce of two integers plus the
layers' all-gathers). Also timed: one all-gather of the full weights (`gathered_weights` entered and left)
and one lockstep exchange (an all-reduce of two int64). Reported per rank and for the slowest rank:
medians, lockstep's forwards (own and one-token) and its cost per forward over the unsharded call; tokens
compared across contenders; raw samples to JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import random
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autobucket import CostCoefficients, Rollout, RolloutConfig, SamplingConfig
from autobucket.models import build_tiny_model

MODES = ("unsharded", "gathered", "lockstep")


def rank_workload(args: argparse.Namespace, rank: int) -> tuple[list[list[int]], int]:
    rng = random.Random(1000 + rank)
    count = args.prompts + rank * args.extra_prompts
    prompts = [[rng.randrange(3, args.vocab) for _ in range(rng.randrange(16, 129))] for _ in range(count)]
    return prompts, args.new_tokens + rank * args.extra_tokens


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            fully_shard(module)
    return fully_shard(model)


@contextlib.contextmanager
def recorded_protocols(log: list):
    """The lockstep protocol of each call (its own forwards, one-token forwards, exchanges)."""
    from autobucket.engine import rollout

    original = rollout.lockstep_forwards

    @contextlib.contextmanager
    def recorded(*args, **kwargs):
        with original(*args, **kwargs) as protocol:
            yield protocol
        log.append({"forwards": protocol.forwards, "dummy_forwards": protocol.dummy_forwards, "exchanges": protocol.exchanges})

    rollout.lockstep_forwards = recorded
    try:
        yield
    finally:
        rollout.lockstep_forwards = original


def timed(function, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        function()
        samples.append((time.perf_counter() - started) * 1e3)
    return samples


def rank_main(rank: int, world: int, port: str, args: argparse.Namespace, out: str) -> None:
    from autobucket.engine.model_access.sharded_weights import gathered_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(args.threads)
    if args.pin_ranks:  # each rank on a core of its own, as trainers' ranks each have their device
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build_tiny_model(args.model, seed=args.seed)
    args.vocab = model.config.vocab_size
    plain, sharded = model, shard(copy.deepcopy(model))
    prompts, budget = rank_workload(args, rank)
    sampling = SamplingConfig(max_new_tokens=budget, eos_token_id=[])
    with torch.no_grad():
        sharded(torch.tensor([[5, 6, 7]]))  # FSDP's lazy initialisation, on every rank
    rollouts = {
        mode: Rollout(plain if mode == "unsharded" else sharded, config=RolloutConfig(
            costs=CostCoefficients(), kernels=args.kernels, sharded_weights="lockstep" if mode == "lockstep" else "gathered"))
        for mode in MODES
    }
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    tokens: dict[str, list] = {}
    protocols: list[dict] = []
    with recorded_protocols(protocols):
        for round_ in range(args.repeats + 1):  # round 0: the warm-up, not recorded
            for mode in MODES:
                dist.barrier()
                started = time.perf_counter()
                tokens[mode] = rollouts[mode].generate(prompts, sampling).tokens
                if round_:
                    samples[mode].append((time.perf_counter() - started) * 1e3)

    def all_gather_weights() -> None:
        with gathered_weights(sharded):
            pass

    flags = torch.zeros(2, dtype=torch.int64)
    record = {
        "rank": rank, "prompts": len(prompts), "new_tokens": budget,
        "samples_ms": samples, "median_ms": {mode: statistics.median(s) for mode, s in samples.items()},
        "weights_all_gather_ms": statistics.median(timed(all_gather_weights, max(args.repeats, 3))),
        "exchange_ms": statistics.median(timed(lambda: dist.all_reduce(flags), 20)),
        "lockstep_protocol": protocols[-1],
        "tokens_agree": {mode: tokens[mode] == tokens["unsharded"] for mode in MODES},
    }  # fmt: skip
    every = [None] * world
    dist.all_gather_object(every, record)
    dist.barrier()  # no rank tears its process group down while another still uses it
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(every))


def summary(ranks: list[dict], args: argparse.Namespace) -> dict:
    """The slowest rank's medians (a call ends for the trainer when its last rank is done), and lockstep's
    cost per forward over the unsharded call on that rank."""
    slowest = {mode: max(r["median_ms"][mode] for r in ranks) for mode in MODES}
    protocol = ranks[0]["lockstep_protocol"]
    forwards = protocol["forwards"] + protocol["dummy_forwards"]  # the same on every rank
    return {
        "model": args.model, "kernels": args.kernels, "threads_per_rank": args.threads, "repeats": args.repeats,
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "slowest_rank_median_ms": slowest,
        "gathered_over_unsharded_ms": slowest["gathered"] - slowest["unsharded"],
        "weights_all_gather_ms": max(r["weights_all_gather_ms"] for r in ranks),
        "exchange_ms": max(r["exchange_ms"] for r in ranks),
        "lockstep_forwards_per_rank": forwards,
        "lockstep_cost_per_forward_ms": (slowest["lockstep"] - slowest["unsharded"]) / max(forwards, 1),
        "tokens_agree": all(all(r["tokens_agree"].values()) for r in ranks),
        "ranks": ranks,
    }  # fmt: skip


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-qwen2", help="a TINY_CONFIGS name")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=8, help="rank 0's prompts")
    parser.add_argument("--extra-prompts", type=int, default=4, help="each further rank's additional prompts")
    parser.add_argument("--new-tokens", type=int, default=16, help="rank 0's new tokens per prompt")
    parser.add_argument("--extra-tokens", type=int, default=16, help="each further rank's additional new tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--pin-ranks", action="store_true", help="pin rank r to the r-th core this process may use")
    parser.add_argument("--kernels", default="auto", choices=("auto", "invariant", "torch"), help="every contender's kernel set")
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the summary and raw samples")
    args = parser.parse_args()
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"sharded_modes-{os.getpid()}.json"
    mp.spawn(rank_main, args=(args.world, free_port(), args, str(scratch)), nprocs=args.world, join=True)
    result = summary(json.loads(scratch.read_text()), args)
    scratch.unlink()
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps({k: v for k, v in result.items() if k != "ranks"}, indent=1))


if __name__ == "__main__":
    main()
