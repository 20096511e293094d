"""Rollout on a model sharded over 2 ranks with FSDP2 (`fully_shard`, CPU, gloo), each rank with its own
prompts and budgets (rank 0: 3 prompts, 4 new tokens; rank 1: 5 prompts, 9), as trainers generate.

Oracle: single-request HF `generate` on the unsharded model (the same seed), per rank and route; the
trainer's sharded forward under `autobucket.invariant` for the sampled logprobs; the model's state and a
sharded forward's logits before and after each call. Negative control: without gathering, the sharded
forward's per-layer all-gathers at every step leave the rank with more work on a collective nobody joins.

The ranks run `sharded_worker.py` (two processes, a free port, a hard timeout each); the scenarios that
pass share one pair of processes (one start-up), the control has its own.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from oracles import hf_greedy

pytest.importorskip("torch.distributed.fsdp")

WORKER = Path(__file__).with_name("sharded_worker.py")
SOURCE = Path(__file__).resolve().parents[2] / "src"
TIMEOUT_S = 240  # a hang ends here; a passing pair takes a fraction of it
CONTROLS = ("per_layer", "unpaired")  # scenarios expected to hang or fail (test_sharded_lockstep.py's too)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(scenario: str, tmp_path: Path, timeout_s: float = TIMEOUT_S, worker: Path = WORKER) -> list[dict | None]:
    """Each rank's JSON (None: it died or was stopped), after both ended or were killed at the timeout."""
    import os

    env = {**os.environ, "PYTHONPATH": f"{SOURCE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    port, outputs = str(free_port()), [tmp_path / f"{scenario}-{rank}.json" for rank in range(2)]
    ranks = [subprocess.Popen([sys.executable, str(worker), scenario, str(rank), "2", port, str(outputs[rank])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]  # fmt: skip
    logs = []
    for rank in ranks:
        try:
            logs.append(rank.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            rank.kill()
            logs.append(rank.communicate()[0] + "\n(killed at the timeout)")
    results = [json.loads(path.read_text()) if path.exists() else None for path in outputs]
    if scenario not in CONTROLS:
        assert all(results), "a rank did not finish:\n" + "\n".join(log[-3000:] for log in logs)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks("all", tmp_path_factory.mktemp("sharded"))


@pytest.fixture(scope="module")
def worker():
    sys.path.insert(0, str(WORKER.parent))
    import sharded_worker

    return sharded_worker


@pytest.mark.parametrize("scenario", ["gathered", "peft"])
def test_every_rank_and_route_equals_single_request_generate_on_the_unsharded_model(scenario, ranks, worker):
    model = worker.build(scenario)
    for rank, out in enumerate(ranks):
        prompts, budget = worker.rank_prompts(rank)
        expected = hf_greedy(model, prompts, budget)
        for route, tokens in out[scenario]["tokens"].items():
            assert tokens == expected, (scenario, rank, route)
        assert out[scenario]["state_kept"], "the model is not as it was found (parameters, hooks or FSDP flags)"
        assert out[scenario]["logits_kept"]


def test_a_rank_holds_the_full_weights_only_inside_the_call(ranks, worker):
    """The memory bound: gathered, a rank holds every parameter byte of the unsharded model; outside the
    call, what FSDP holds (the layers' shards; the root's weights stay unsharded after a forward, FSDP's
    own default for the root)."""
    full = sum(p.nbytes for p in worker.build("gathered").parameters())
    held = [out["gathered"]["bytes"] for out in ranks]
    assert [h["gathered"] for h in held] == [full, full]
    assert all(h["sharded"] < full for h in held), held


def test_ranks_making_different_numbers_of_calls_inside_one_gather_stay_exact(ranks, worker):
    model = worker.build("nested")
    for rank, out in enumerate(ranks):
        prompts, budget = worker.rank_prompts(rank)
        assert out["nested"]["tokens"] == hf_greedy(model, prompts, budget)
        assert out["nested"]["state_kept"] and out["nested"]["logits_kept"]


def test_the_lora_adapter_inside_the_sharded_model_runs(ranks, worker):
    """The PeftModel's tokens are not the base model's: its adapter ran in the gathered forwards."""
    base = worker.build("gathered")
    prompts, budget = worker.rank_prompts(1)
    assert ranks[1]["peft"]["tokens"]["auto"] != hf_greedy(base, prompts, budget)


def test_a_rank_refusing_its_input_stops_every_rank_with_the_reason(ranks):
    refused, peer = ranks[1]["bad_input"], ranks[0]["bad_input"]
    assert refused["error"].startswith("ValueError: prompt 0 has token id 1027 outside the vocabulary")
    assert peer["error"].startswith("RuntimeError: rank 1 refused its generate call (ValueError: prompt 0 has")
    assert "fix rank 1's input and call again" in peer["error"]
    # both ranks went on in step: the next sharded forward (collectives on both) ran, the model as found
    assert refused["logits_kept"] and peer["logits_kept"] and refused["state_kept"] and peer["state_kept"]


def test_sampled_logprobs_equal_the_trainers_sharded_forward_under_invariant_bitwise(ranks):
    for out in ranks:
        invariant = out["invariant"]
        assert invariant["scoped"] == invariant["sampled"]
        assert invariant["unscoped"] != invariant["sampled"]  # control: the model's own kernels differ


def test_control_per_layer_collectives_with_uneven_work_fail(tmp_path):
    """What gathering prevents: ranks running different numbers of sharded forwards fall out of step, so
    one rank fails (its peer gone mid-collective) or hangs until the timeout."""
    results = run_ranks("per_layer", tmp_path, timeout_s=120)
    assert not all(results)
