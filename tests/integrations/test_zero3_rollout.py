"""`AutobucketRollout` on a DeepSpeed ZeRO-3 engine over 2 ranks (CPU accelerator, gloo; every parameter
partitioned), each rank with its own prompts and budgets (rank 0: 3 prompts, 4 new tokens; rank 1: 5, 9).

Oracle: single-request HF `generate` on the unsharded model, per rank and route; the engine's state (every
parameter partitioned again, the same hooks and module ids) and a forward through ZeRO-3's hooks before and
after. Negative control: without the gathering, ZeRO-3's per-submodule gathers at every forward leave the
rank with more work on a collective nobody joins. The ranks run `zero3_worker.py` (two processes, a free
port, a hard timeout); DeepSpeed's first start compiles a small op (cached after).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from oracles import oracle_batch
from test_sharded_models import SOURCE, TIMEOUT_S, free_port

pytest.importorskip("deepspeed")

WORKER = Path(__file__).with_name("zero3_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[tuple[dict, Path]]:
    folder = tmp_path_factory.mktemp("zero3")
    env = {**os.environ, "PYTHONPATH": f"{SOURCE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    port, outputs = str(free_port()), [folder / f"rank{rank}.json" for rank in range(2)]
    processes = [subprocess.Popen([sys.executable, str(WORKER), str(rank), port, str(outputs[rank])], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]  # fmt: skip
    logs = []
    for process in processes:
        try:
            logs.append(process.communicate(timeout=TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:  # the control's hang, or a failure: the outputs say which
            process.kill()
            logs.append(process.communicate()[0] + "\n(killed at the timeout)")
    assert all(path.exists() for path in outputs), "a rank did not finish:\n" + "\n".join(log[-3000:] for log in logs)
    return [(json.loads(path.read_text()), path) for path in outputs]


def test_every_rank_and_route_equals_single_request_generate_on_the_unsharded_model(ranks):
    sys.path.insert(0, str(WORKER.parent))
    from sharded_worker import build, rank_prompts
    from zero3_worker import EOS

    model = build("gathered")
    for rank, (out, _) in enumerate(ranks):
        prompts, budget = rank_prompts(rank)
        expected, _ = oracle_batch(model, prompts, budget, eos_token_id=[EOS])
        for route, tokens in out["tokens"].items():
            assert tokens == expected, (rank, route)
        assert out["state_kept"], "the engine is not as it was found (partitioning, hooks or module ids)"
        assert out["logits_kept"]


def test_a_rank_running_one_forward_while_another_runs_many_stays_exact(ranks):
    """ZeRO-3's start-of-forward hook, left on, broadcasts while the fetch order is unrecorded: a rank with
    one forward would leave the other waiting at its second (the call takes the hook off)."""
    sys.path.insert(0, str(WORKER.parent))
    from sharded_worker import build, rank_prompts
    from zero3_worker import EOS

    model = build("gathered")
    (first, _), (second, _) = ranks
    prompts, budget = rank_prompts(0)
    assert first["uneven"] == oracle_batch(model, prompts[:1], 1, eos_token_id=[EOS])[0]
    prompts, budget = rank_prompts(1)
    assert second["uneven"] == oracle_batch(model, prompts, budget, eos_token_id=[EOS])[0]


def test_a_rank_refusing_its_input_raises_on_every_rank_with_the_reason(ranks):
    (peer, _), (refused, _) = ranks
    assert refused["error"] == "ValueError: max_new_tokens=-1 is invalid: expected an int >= 1"
    assert peer["error"].startswith("RuntimeError: rank 1 refused its generate call (ValueError: max_new_tokens=-1")


def test_control_per_submodule_gathers_with_uneven_work_fail(ranks):
    finished = [path.with_name(path.name + ".control").exists() for _, path in ranks]
    assert not all(finished)
