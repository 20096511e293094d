"""Tool calling through `AutobucketGRPOTrainer(engine="async")`: TRL's tool loop calls the adapter again for
every later turn, and each turn's requests go to the trainer's one engine.

Oracles, with `kernels="invariant"` under TRL's fused AdamW (which bumps no version counter): the stock
`GRPOTrainer` with the same tools (greedy: the same prompts and completions at every turn of every step),
and the adapter's rollout mode (also the same tool masks and bitwise the same final weights). The
negative control for the engine missing the weight updates is in test_integration_trl_async.py."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

import test_integration_trl_tools as tool_tests  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from autobucket import RolloutConfig  # noqa: E402
from autobucket.integrations.trl import AutobucketGRPOTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
eos_id = tool_tests.eos_id  # the tool tests' end-of-turn choice (some conversations call the tool, some not)


@pytest.fixture(scope="module")
def stock(tmp_path_factory, eos_id):
    run = tool_tests.run_grpo(GRPOTrainer, tmp_path_factory.mktemp("stock"), eos_id)
    assert tool_tests.tool_turns(run), "no completion called the tool: the workload does not exercise TRL's tool loop"
    return run


def test_greedy_tool_grpo_on_the_async_engine_matches_stock_and_rollout_mode(stock, tmp_path, eos_id):
    """Every turn's completions are the stock trainer's; with invariant kernels the trainer's scoring is
    autobucket's too, so the final weights are compared with the rollout mode's (bitwise)."""
    config = RolloutConfig(route="auto", kernels="invariant")
    run = tool_tests.run_grpo(AutobucketGRPOTrainer, tmp_path / "async", eos_id, rollout_config=config, engine="async")
    assert run.trainer.args.optim == "adamw_torch_fused"  # the optimizer whose writes counters miss
    assert run.trainer.autobucket_routes == ["async"]
    assert [c for _, _, c in run.turns] == [c for _, _, c in stock.turns]
    assert [p for _, p, _ in run.turns] == [p for _, p, _ in stock.turns]
    rollout_mode = tool_tests.run_grpo(AutobucketGRPOTrainer, tmp_path / "rollout", eos_id, rollout_config=config)
    tool_tests.assert_same_training(run, rollout_mode)
