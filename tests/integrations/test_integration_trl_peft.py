"""`AutobucketGRPOTrainer` with `peft_config` (TRL wraps the model in a LoRA `PeftModel` itself; with
GRPOConfig's default gradient checkpointing on, which TRL turns off around generation).

Oracle: the stock `GRPOTrainer` with the same `peft_config` over the same three real greedy steps:
identical completions and bit-identical final adapter weights (`get_peft_model_state_dict`). The adapter
must have moved and the base weights must not (training really ran, on the adapter only). Negative
control: the same trainer generating with the adapter disabled differs from the stock completions, so
the comparison catches generation that bypasses the adapter.

No LoRA dropout here: autobucket generates with eval semantics, while TRL's own transformers path
generates in train() mode, so with `lora_dropout > 0` the two agree only under `disable_dropout=True`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
peft = pytest.importorskip("peft")

import test_integration_trl as stock_trl_tests  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from autobucket import RolloutConfig  # noqa: E402
from autobucket.integrations import trl as autobucket_trl  # noqa: E402
from autobucket.integrations.trl import AutobucketGRPOTrainer, make_rollout_func  # noqa: E402
from autobucket.models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
eos_id = stock_trl_tests.eos_id  # the same EOS choice as the full-model tests (fires for some prompts only)
grpo_config, prompt_texts, word_tokenizer = (
    stock_trl_tests.grpo_config, stock_trl_tests.prompt_texts, stock_trl_tests.word_tokenizer,
)

LORA_TARGETS = ["q_proj", "v_proj", "up_proj"]


@dataclass
class PeftRun:
    completions: list  # per generation call: completion id lists, in TRL's row order
    initial_adapter: dict  # adapter weights as TRL initialised them (peft: B = 0), before the first step
    adapter: dict  # final adapter weights (get_peft_model_state_dict)
    base: dict  # final non-adapter weights, under the plain model's names
    routes: list | None  # the routes autobucket ran for the last batch (None: TRL generated)


def base_weights(model) -> dict:
    """Non-adapter weights under the plain model's names (a PeftModel prefixes `base_model.model.` and
    keeps each adapted linear's own weight under `.base_layer`)."""
    plain = lambda key: key.removeprefix("base_model.model.").replace(".base_layer.", ".")  # noqa: E731
    return {plain(k): v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def adapter_weights(model) -> dict:
    return {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}


def run_peft_grpo(trainer_cls, tmp_path, eos_id, **trainer_kwargs) -> PeftRun:
    model, tokenizer = build_tiny_model("tiny-qwen2"), word_tokenizer(eos_id)
    completions: list = []

    def toy_reward(completion_ids, **kwargs):  # also records what TRL scored
        completions.append([list(ids) for ids in completion_ids])
        return [float(len(set(ids)) + sum(ids) % 5) for ids in completion_ids]

    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS)
    trainer = trainer_cls(
        model=model, reward_funcs=toy_reward, args=grpo_config(tmp_path, greedy=True),
        train_dataset=Dataset.from_dict({"prompt": prompt_texts()}), processing_class=tokenizer,
        peft_config=lora, **trainer_kwargs,
    )
    assert isinstance(trainer.model, peft.PeftModel)
    initial = adapter_weights(trainer.model)
    trainer.train()
    routes = getattr(trainer, "autobucket_routes", None)
    return PeftRun(completions, initial, adapter_weights(trainer.model), base_weights(trainer.model), routes)


def differing(got: dict, want: dict) -> list[str]:
    assert got.keys() == want.keys()
    return [k for k in want if not torch.equal(got[k], want[k])]


def assert_same_peft_training(got: PeftRun, want: PeftRun) -> None:
    assert got.completions == want.completions
    assert not differing(got.adapter, want.adapter), "final adapter weights differ"
    assert differing(got.adapter, got.initial_adapter), "training did not move the adapter"
    assert not differing(got.base, base_weights(build_tiny_model("tiny-qwen2"))), "base weights changed"


@pytest.fixture(scope="module")
def stock_peft(tmp_path_factory, eos_id) -> PeftRun:
    run = run_peft_grpo(GRPOTrainer, tmp_path_factory.mktemp("stock-peft"), eos_id)
    assert len(run.completions) == 3 and run.adapter
    assert not differing(run.base, base_weights(build_tiny_model("tiny-qwen2")))
    assert differing(run.adapter, run.initial_adapter), "training did not move the adapter"
    return run


@pytest.mark.parametrize("route", ["ordinary", "auto"])
def test_peft_greedy_grpo_matches_stock_trainer(route, stock_peft, tmp_path, eos_id):
    run = run_peft_grpo(AutobucketGRPOTrainer, tmp_path, eos_id, rollout_config=RolloutConfig(route=route))
    assert run.routes == [{"auto": "bucketed"}.get(route, route)]
    assert_same_peft_training(run, stock_peft)


def test_peft_rollout_func_matches_stock_trainer(stock_peft, tmp_path, eos_id):
    rollout_func = make_rollout_func(RolloutConfig(route="aligned"))
    assert_same_peft_training(run_peft_grpo(GRPOTrainer, tmp_path, eos_id, rollout_func=rollout_func), stock_peft)


def test_peft_control_generating_without_the_adapter_differs(stock_peft, tmp_path, eos_id, monkeypatch):
    """The oracle can fail: generating with the adapter disabled (what an unwrap that lost the LoRA
    layers would do) gives other completions once the adapter has trained."""
    real_generate = autobucket_trl.generate_completions

    def adapter_disabled(trainer, *args):
        with trainer.model.disable_adapter():  # generation only; the training steps still use the adapter
            return real_generate(trainer, *args)

    monkeypatch.setattr(autobucket_trl, "generate_completions", adapter_disabled)
    run = run_peft_grpo(AutobucketGRPOTrainer, tmp_path, eos_id, rollout_config=RolloutConfig(route="auto"))
    assert run.completions[0] == stock_peft.completions[0]  # B = 0 at step 1: the adapter is a no-op yet
    assert run.completions != stock_peft.completions

