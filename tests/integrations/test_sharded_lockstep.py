"""`RolloutConfig(sharded_weights="lockstep")` on a model sharded over 2 ranks with FSDP2 (`fully_shard`,
CPU, gloo), and on a DeepSpeed ZeRO-3 engine's module: each rank keeps its shards and runs the sharded forward, every forward paired across ranks,
each rank with its own prompts and budgets (rank 0: 3 prompts, 4 new tokens; rank 1: 5 prompts, 9).

Oracle: single-request HF `generate` on the unsharded model, per rank and route (and with the ranks on
different routes in one call); the collectives each rank made (equal counts on both ranks); the trainer's
sharded forward under `autobucket.invariant` for the sampled logprobs; the model's state and a sharded
forward's logits before and after each call. Negative control: the same sharded forwards with the lockstep
protocol off leave the rank with more work on a collective nobody joins.

The ranks run `lockstep_worker.py` / `zero3_lockstep_worker.py` (two processes, a free port, a hard timeout
each); the scenarios that pass share one pair of processes per stack, each control has its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from oracles import hf_greedy
from test_sharded_models import run_ranks

pytest.importorskip("torch.distributed.fsdp")

WORKER = Path(__file__).with_name("lockstep_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    # seven calls per rank, each forward paired: room for a loaded machine; a hang still ends here
    return run_ranks("all", tmp_path_factory.mktemp("lockstep"), timeout_s=480, worker=WORKER)


@pytest.fixture(scope="module")
def worker():
    import sys

    sys.path.insert(0, str(WORKER.parent))
    import sharded_worker

    return sharded_worker


@pytest.fixture(scope="module")
def expected(worker) -> list[list[list[int]]]:
    """Each rank's tokens: single-request HF generate on the unsharded model."""
    model = worker.build("gathered")
    return [hf_greedy(model, *worker.rank_prompts(rank)) for rank in range(2)]


def test_every_rank_and_route_equals_single_request_generate_on_the_unsharded_model(ranks, expected):
    for rank, out in enumerate(ranks):
        for route, call in out["routes"]["routes"].items():
            assert call["tokens"] == expected[rank], (rank, route)
            assert call["decode_step"] == "model"  # the engine's step would read the shards, not the layer
        assert out["routes"]["state_kept"], "the model is not as it was found (parameters, hooks or FSDP flags)"
        assert out["routes"]["logits_kept"]


def test_ranks_on_different_routes_in_one_call_stay_exact(ranks, expected):
    """Rank 0 runs HF generate (route ordinary), rank 1 the engine's continuous batching (bucketed): the
    protocol pairs forwards, not route steps."""
    assert [out["mixed"]["route"] for out in ranks] == ["ordinary", "bucketed"]
    for rank, out in enumerate(ranks):
        assert out["mixed"]["tokens"] == expected[rank]
        assert out["mixed"]["state_kept"] and out["mixed"]["logits_kept"]


def calls(ranks: list[dict]) -> list[tuple[str, list[dict]]]:
    """(name, each rank's record) of every lockstep call the ranks made that finished."""
    named = [(f"routes/{route}", [out["routes"]["routes"][route] for out in ranks]) for route in ("auto", "ordinary", "bucketed")]
    return named + [(name, [out[name] for out in ranks]) for name in ("mixed", "empty", "peft")]


def test_a_lora_peft_model_as_the_fsdp_root_equals_single_request_generate(ranks, worker):
    """The root FSDP module is the PeftModel, above the model the engine calls: its group (the
    embeddings' shards) is gathered for the call; the adapter runs (its tokens are not the base model's)."""
    model = worker.build("peft")
    for rank, out in enumerate(ranks):
        prompts, budget = worker.rank_prompts(rank)
        assert out["peft"]["tokens"] == hf_greedy(model, prompts, budget), rank
        assert out["peft"]["state_kept"] and out["peft"]["logits_kept"]
    assert ranks[1]["peft"]["tokens"] != hf_greedy(worker.build("gathered"), *worker.rank_prompts(1))


def test_every_forward_is_paired_by_one_all_reduce_and_the_same_all_gathers_on_every_rank(ranks):
    for name, pair in calls(ranks):
        counts = [call["counts"] for call in pair]
        (first, *_), (second, *_) = (c["protocols"] for c in counts)
        ran = [p["forwards"] + p["dummy_forwards"] for p in (first, second)]
        assert ran[0] == ran[1] and ran[0] > 0, (name, first, second)
        # one exchange before each forward, and the last one at which every rank was done
        assert first["exchanges"] == second["exchanges"] == ran[0] + 1, name
        assert [c["all_reduce"] for c in counts] == [ran[0] + 1] * 2, name  # the exchanges, nothing else
        assert counts[0]["all_gather"] == counts[1]["all_gather"] > 0, name  # FSDP's, per forward
        # the rank with less work ran one-token forwards to pair with the other's
        assert min(first["dummy_forwards"], second["dummy_forwards"]) == 0 < max(first["dummy_forwards"], second["dummy_forwards"])


def test_a_rank_with_no_prompts_only_pairs_the_others_forwards(ranks, expected):
    empty, busy = ranks[0]["empty"], ranks[1]["empty"]
    assert empty["tokens"] == [] and busy["tokens"] == expected[1]
    (idle,), (working,) = empty["counts"]["protocols"], busy["counts"]["protocols"]
    assert idle["forwards"] == 0 and idle["dummy_forwards"] == working["forwards"] > 0
    assert empty["state_kept"] and busy["state_kept"] and empty["logits_kept"] and busy["logits_kept"]


def test_no_rank_holds_the_full_weights_during_the_call(ranks):
    """Inside a layer's forward a rank holds that layer's full weights and the others' shards: more than
    its shards alone, less than the unsharded model (which the gathered mode holds for the whole call)."""
    for out in ranks:
        for name, call in (("routes/auto", out["routes"]["routes"]["auto"]), ("mixed", out["mixed"])):
            assert out["routes"]["bytes"]["held"] < call["most_held"] < out["routes"]["bytes"]["full"], name


def test_sampled_logprobs_equal_the_trainers_sharded_forward_under_invariant_bitwise(ranks):
    for out in ranks:
        invariant = out["invariant"]
        assert invariant["kernels"] == "invariant" and invariant["packed_weight_bytes"] == 0  # no copy of the weights
        assert invariant["scoped"] == invariant["sampled"]
        assert invariant["unscoped"] != invariant["sampled"]  # control: the model's own kernels differ


def test_a_rank_refusing_its_input_stops_every_rank_with_the_reason(ranks):
    refused, peer = ranks[1]["bad_input"], ranks[0]["bad_input"]
    assert refused["error"].startswith("ValueError: prompt 0 has token id 1027 outside the vocabulary")
    assert peer["error"].startswith("RuntimeError: rank 1 refused its generate call (ValueError: prompt 0 has")
    assert refused["logits_kept"] and peer["logits_kept"] and refused["state_kept"] and peer["state_kept"]


def test_a_rank_failing_between_its_forwards_stops_every_rank_with_the_reason(ranks):
    """Rank 1's logits processor raises at its third call, while both ranks still generate: every rank
    stops at the next exchange, rank 1 raising its own error, rank 0 one naming it; both go on in step."""
    failed, peer = ranks[1]["failing"], ranks[0]["failing"]
    assert failed["error"] == "ValueError: the reward shaper's processor failed at step 3"
    assert peer["error"].startswith("RuntimeError: rank 1 refused its generate call (ValueError: the reward shaper's")
    assert failed["logits_kept"] and peer["logits_kept"] and failed["state_kept"] and peer["state_kept"]


def test_control_unpaired_sharded_forwards_with_uneven_work_fail(tmp_path):
    """What the protocol prevents: the same sharded forwards, unpaired, fall out of step, so one rank fails
    (its peer gone mid-collective) or hangs until the timeout."""
    results = run_ranks("unpaired", tmp_path, timeout_s=120, worker=WORKER)
    assert not all(results)


def test_lockstep_is_accepted_and_refuses_a_compiled_forward():
    from autobucket import RolloutConfig

    assert RolloutConfig().sharded_weights == "gathered"
    assert RolloutConfig(sharded_weights="lockstep").sharded_weights == "lockstep"
    for compile in (True, "auto"):
        with pytest.raises(ValueError, match=rf"sharded_weights='lockstep' with compile={compile!r} is refused: .*pass compile=False"):
            RolloutConfig(sharded_weights="lockstep", compile=compile)
    with pytest.raises(ValueError, match=r"sharded_weights='stepped' is invalid: expected one of 'gathered', 'lockstep'"):
        RolloutConfig(sharded_weights="stepped")


# ---------------------------------------------------------------- DeepSpeed ZeRO-3 (`engine.module` handed over)
ZERO3_WORKER = Path(__file__).with_name("zero3_lockstep_worker.py")


@pytest.fixture(scope="module")
def zero3_ranks(tmp_path_factory) -> list[dict]:
    pytest.importorskip("deepspeed")
    return run_ranks("all", tmp_path_factory.mktemp("zero3_lockstep"), timeout_s=480, worker=ZERO3_WORKER)


def test_zero3_every_rank_route_and_mix_of_routes_equals_single_request_generate(zero3_ranks, expected):
    for rank, out in enumerate(zero3_ranks):
        for route, call in out["routes"].items():
            assert call["tokens"] == expected[rank], (rank, route)
        assert out["mixed"]["tokens"] == expected[rank]
        assert out["state_kept"], "the engine is not as it was found (partitioning, hooks or module ids)"
        assert out["logits_kept"]
    assert [out["mixed"]["route"] for out in zero3_ranks] == ["ordinary", "bucketed"]


def test_zero3_forwards_are_paired_and_a_rank_with_no_prompts_only_pairs(zero3_ranks, expected):
    for name in ("auto", "ordinary", "bucketed"):
        first, second = (out["routes"][name]["protocols"][0] for out in zero3_ranks)
        assert first["forwards"] + first["dummy_forwards"] == second["forwards"] + second["dummy_forwards"], name
        assert first["exchanges"] == second["exchanges"] == first["forwards"] + first["dummy_forwards"] + 1, name
    idle, busy = (out["empty"] for out in zero3_ranks)
    assert idle["tokens"] == [] and busy["tokens"] == expected[1]
    assert idle["protocols"][0]["forwards"] == 0 and idle["protocols"][0]["dummy_forwards"] == busy["protocols"][0]["forwards"]


def test_zero3_refusal_and_invariant_logprobs(zero3_ranks):
    assert zero3_ranks[1]["bad_input"].startswith("ValueError: prompt 0 has token id 1027 outside the vocabulary")
    assert zero3_ranks[0]["bad_input"].startswith("RuntimeError: rank 1 refused its generate call (ValueError: prompt 0")
    for out in zero3_ranks:
        invariant = out["invariant"]
        assert invariant["packed_weight_bytes"] == 0
        assert invariant["scoped"] == invariant["sampled"]
        assert invariant["unscoped"] != invariant["sampled"]  # control: the model's own kernels differ


def test_zero3_control_unpaired_forwards_with_uneven_work_fail(tmp_path):
    pytest.importorskip("deepspeed")
    assert not all(run_ranks("unpaired", tmp_path, timeout_s=120, worker=ZERO3_WORKER))
