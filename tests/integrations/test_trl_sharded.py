"""TRL's GRPO trainer on a model sharded over 2 CPU processes (gloo), launched by `accelerate launch`:
DeepSpeed ZeRO-3 (accelerate's DeepSpeed plugin, every parameter partitioned) and FSDP2 (accelerate's FSDP
plugin, `fully_shard` on each decoder layer and the root). Each rank trains on its own half of every
generation batch (uneven prompt lengths), as accelerate deals it.

Oracles: the stock `GRPOTrainer` (TRL's own generation, lockstep `generate` under FSDP2, gathered under
ZeRO-3) on the same seed: the same greedy completions on every rank and step, and bitwise the same final
weights; TRL's own logged `mismatch/k3` and `mismatch/max_abs_logp_diff` with kernels="invariant" (0.0 at
every step). Controls: the default kernels log a non-zero mismatch on the same run; the weights moved; the
ranks generated for different prompts; a refusal not shared between ranks leaves the other rank without
the reason (a dropped connection, or a hang until the timeout).

The ranks run `trl_sharded_worker.py`, every scenario in one launch per backend (one start-up).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_sharded_models import SOURCE, free_port

pytest.importorskip("trl")
pytest.importorskip("deepspeed")

WORKER = Path(__file__).with_name("trl_sharded_worker.py")
TIMEOUT_S = 300  # a hang ends here; a launch takes a fraction of it
SCENARIOS = ("stock", "greedy", "invariant", "default_kernels", "bad_input", "bad_token", "unshared")
ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "zero_allow_untested_optimizer": True,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
LAUNCH = {
    "zero3": ["--use_deepspeed", "--deepspeed_config_file", "{folder}/zero3.json"],
    "fsdp2": ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
              "--fsdp_transformer_layer_cls_to_wrap", "Qwen2DecoderLayer", "--fsdp_cpu_ram_efficient_loading",
              "false", "--fsdp_state_dict_type", "SHARDED_STATE_DICT"],
}  # fmt: skip


def launch(backend: str, folder: Path) -> tuple[list[dict], str]:
    """`accelerate launch --num_processes 2` of the worker; each rank's JSON (missing scenarios: it did not
    finish them) and the launch's log, after it ended or was stopped at the timeout."""
    (folder / "zero3.json").write_text(json.dumps(ZERO3))
    flags = [flag.format(folder=folder) for flag in LAUNCH[backend]]
    command = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--num_processes", "2",
               "--main_process_port", str(free_port()), str(WORKER), backend, str(folder), ",".join(SCENARIOS)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{SOURCE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # fmt: skip
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        log = process.communicate(timeout=TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:  # the control's hang: the launcher and both ranks, by their group
        os.killpg(process.pid, signal.SIGTERM)
        log = process.communicate()[0] + "\n(stopped at the timeout)"
    paths = [folder / f"rank{rank}.json" for rank in range(2)]
    return [json.loads(path.read_text()) if path.exists() else {} for path in paths], log


@pytest.fixture(scope="module", params=["zero3", "fsdp2"])
def ranks(request, tmp_path_factory) -> list[dict]:
    results, log = launch(request.param, tmp_path_factory.mktemp(request.param))
    finished = [all(scenario in out for scenario in SCENARIOS[:-1]) for out in results]
    assert all(finished), "a rank did not finish:\n" + log[-6000:]
    return results


def initial_digests() -> dict[str, str]:
    sys.path.insert(0, str(WORKER.parent))
    from trl_sharded_worker import MODEL, digest

    from autobucket.models import build_tiny_model

    return {name: digest(p) for name, p in build_tiny_model(MODEL).named_parameters()}


def test_accelerate_shards_every_parameter(ranks, request):
    expected = {"zero3": "DistributedType.DEEPSPEED", "fsdp2": "DistributedType.FSDP"}[request.node.callspec.params["ranks"]]
    for out in ranks:
        for scenario in SCENARIOS[:-1]:
            held = out[scenario]["sharding"]
            assert held["distributed_type"] == expected
            assert held["partitioned"] == held["parameters"] > 0, (scenario, held)


def test_greedy_completions_and_final_weights_equal_the_stock_trainers(ranks):
    for out in ranks:
        stock, ours = out["stock"], out["greedy"]
        assert len(stock["completions"]) == 2  # one generation batch per step
        assert ours["completions"] == stock["completions"]
        assert ours["weights"] == stock["weights"]
        assert ours["routes"] == ["bucketed"]  # auto ran continuous batching, not HF generate
    assert ranks[0]["greedy"]["weights"] == ranks[1]["greedy"]["weights"]  # one model, trained together
    # controls: training moved the weights; the ranks generated for different prompts; EOS ended some
    # completions early and others ran to the budget
    assert ranks[0]["stock"]["weights"] != initial_digests()
    assert ranks[0]["stock"]["completions"] != ranks[1]["stock"]["completions"]
    rows = [row for out in ranks for batch in out["stock"]["completions"] for row in batch]
    eos = ranks[0]["eos"]
    assert any(row[-1] == eos and len(row) < 8 for row in rows) and any(eos not in row and len(row) == 8 for row in rows)


def test_invariant_kernels_log_zero_mismatch_at_every_step(ranks):
    """TRL's own logged metrics (each rank's loss logprobs against its sampling logprobs): exactly 0.0 at
    both steps on both ranks. Control: the default kernels, same sampled tokens, log a non-zero mismatch."""
    for out in ranks:
        assert out["invariant"]["mismatch"] == [[0.0, 0.0], [0.0, 0.0]]
        assert out["default_kernels"]["completions"] == out["invariant"]["completions"]
    assert max(diff for out in ranks for _, diff in out["default_kernels"]["mismatch"]) > 0.0
    assert ranks[0]["invariant"]["completions"] != ranks[1]["invariant"]["completions"]


@pytest.mark.parametrize(
    ("scenario", "reason"),
    [("bad_input", r"ValueError: prompt 2 has \d+ tokens; with max_completion_length=8 it needs \d+ positions "
                   r"but the model's context is 2048"),
     ("bad_token", r"ValueError: prompt 1 has token id 1024 outside the vocabulary \[0, 1024\)")],
)  # fmt: skip
def test_a_rank_refusing_its_input_stops_every_rank_with_the_reason(ranks, scenario, reason):
    """Rank 1's dataset prompt is bad (checked before generating; found inside Rollout.generate): rank 1
    raises its ValueError, rank 0 a RuntimeError naming rank 1 and the reason, within the timeout."""
    peer, refused = ranks[0][scenario]["error"], ranks[1][scenario]["error"]
    assert re.match(reason, refused), refused
    assert re.match(rf"RuntimeError: rank 1 refused its generate call \({reason}", peer), peer


def test_control_a_refusal_not_shared_leaves_the_other_rank_without_the_reason(ranks):
    assert ranks[1]["unshared"]["error"].startswith("ValueError: prompt 1 has token id 1024")
    peer = ranks[0].get("unshared")  # None: it hung until the timeout
    assert peer is None or "rank 1 refused" not in peer.get("error", ""), peer

