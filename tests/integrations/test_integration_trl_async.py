"""`AutobucketGRPOTrainer(engine="async")`: TRL's generation requests through the trainer's `AsyncEngine`
(paused outside generation, closed after `train()`), on TRL 1.16's real GRPO trainer.

Oracles: the stock `GRPOTrainer` (greedy: the same completions, logged lengths and bitwise final weights),
the adapter's synchronous mode (`engine="rollout"`: the same, and with `kernels="invariant"` bitwise the
same sampled completions, sampling logprobs and weights), and TRL's own scoring forward (zero logged
mismatch). Negative controls: an engine on a frozen copy of the initial weights (the pause / resume around
the optimizer step is what makes later steps agree), and another trainer seed (sampled completions)."""

from __future__ import annotations

import copy
import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

import test_integration_trl as stock_trl_tests  # noqa: E402
import torch  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from autobucket import Rollout, RolloutConfig, SamplingConfig  # noqa: E402
from autobucket.integrations import trl_async  # noqa: E402
from autobucket.integrations.trl import AutobucketGRPOTrainer  # noqa: E402
from autobucket.models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
eos_id = stock_trl_tests.eos_id  # the same EOS choice as the full-model tests (fires for some prompts only)
run_grpo, assert_same_training, logged_mismatch = (
    stock_trl_tests.run_grpo, stock_trl_tests.assert_same_training, stock_trl_tests.logged_mismatch,
)


@pytest.fixture(scope="module")
def stock_greedy(tmp_path_factory, eos_id):
    return run_grpo(GRPOTrainer, tmp_path_factory.mktemp("stock"), eos_id)


def engine_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "autobucket-async-engine"]


def parked_during_training(trainer_cls):
    """`trainer_cls` that records, at every loss (after its step's generation, before its backward and
    optimizer step), whether its engine exists and is paused."""

    class Recording(trainer_cls):
        def _compute_loss(self, model, inputs):
            engine = self.autobucket_engine.engine
            self.parked_at_steps = [*getattr(self, "parked_at_steps", []), engine is not None and engine.paused]
            return super()._compute_loss(model, inputs)

    return Recording


def test_greedy_grpo_on_the_async_engine_matches_stock_and_rollout_mode(stock_greedy, tmp_path, eos_id):
    before = engine_threads()
    trainers = []

    class Kept(parked_during_training(AutobucketGRPOTrainer)):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

    run = run_grpo(Kept, tmp_path / "async", eos_id, engine="async", rollout_config=RolloutConfig(route="auto"))
    assert run.routes == ["async"]
    assert_same_training(run, stock_greedy)
    assert_same_training(run, run_grpo(AutobucketGRPOTrainer, tmp_path / "rollout", eos_id))
    assert all(output.get("sampling_per_token_logps") is None for output in run.outputs)  # greedy: as TRL's path
    [trainer] = trainers
    assert trainer.parked_at_steps == [True] * 3  # the engine never runs while the trainer steps
    assert trainer.autobucket_engine.engine is None and engine_threads() == before  # closed after train()


def test_an_engine_that_missed_the_weight_updates_is_caught(stock_greedy, tmp_path, eos_id, monkeypatch):
    """Negative control for the greedy oracle: an engine on a frozen copy of the initial model (as if it
    never saw an optimizer step) agrees at the first step and differs later."""
    made = trl_async.TrainerEngine._engine_for

    def on_a_frozen_copy(self, model, *args):
        if not hasattr(self, "frozen"):  # a new model, not a deepcopy: accelerate's forward wrapper would
            self.frozen = build_tiny_model("tiny-qwen2")  # still call the trainer's model
            self.frozen.load_state_dict(model.state_dict())
        return made(self, self.frozen, *args)

    monkeypatch.setattr(trl_async.TrainerEngine, "_engine_for", on_a_frozen_copy)
    run = run_grpo(AutobucketGRPOTrainer, tmp_path, eos_id, engine="async")
    assert run.completions[0] == stock_greedy.completions[0]
    assert run.completions[1:] != stock_greedy.completions[1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sampled_grpo_with_invariant_kernels_equals_rollout_mode_bitwise(tmp_path, eos_id, dtype):
    """kernels="invariant": the async engine's sampled completions and sampling logprobs are bitwise the
    synchronous adapter's, every step, and so are the final weights; TRL's own scoring forward logs zero
    mismatch against them. Control: another trainer seed samples other completions."""
    config = {"num_generations": 4, "per_device_train_batch_size": len(stock_trl_tests.PROMPT_WORDS) * 4}
    settings = dict(greedy=False, config_overrides=config, dtype=dtype,
                    rollout_config=RolloutConfig(route="auto", kernels="invariant"))  # fmt: skip
    ours = run_grpo(AutobucketGRPOTrainer, tmp_path / "async", eos_id, engine="async", **settings)
    synchronous = run_grpo(AutobucketGRPOTrainer, tmp_path / "rollout", eos_id, **settings)
    assert ours.routes == ["async"] and synchronous.routes == ["bucketed"]
    assert_same_training(ours, synchronous)
    for got, want in zip(ours.outputs, synchronous.outputs, strict=True):
        mask = want["completion_mask"].bool()
        assert mask.sum() > 0 and torch.equal(got["completion_mask"], want["completion_mask"])
        assert torch.equal(got["sampling_per_token_logps"][mask], want["sampling_per_token_logps"][mask])
    assert logged_mismatch(ours) == [(0.0, 0.0)] * 3
    samples = [ids for call in ours.completions for ids in call]
    assert len({tuple(ids) for ids in samples}) > len(samples) // 2, "sampling produced mostly duplicates"
    settings["config_overrides"] = {**config, "seed": 1}
    other_seed = run_grpo(AutobucketGRPOTrainer, tmp_path / "seed1", eos_id, engine="async", **settings)
    assert other_seed.completions[0] != ours.completions[0]


def test_the_engine_grows_for_longer_prompts_and_is_reused_otherwise(tmp_path, eos_id):
    """A call whose prompts need a longer context makes the engine again, sized to fit (powers of two of
    prompt + budget); calls that fit reuse it. Oracle: the rollout mode's completions for the same prompts."""
    texts = stock_trl_tests.prompt_texts((3, 5, 200, 4))
    settings = dict(texts=texts, config_overrides={"per_device_train_batch_size": 4, "max_steps": 2})
    made = []

    class Counting(AutobucketGRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            output = super()._generate_single_turn(*args, **kwargs)
            made.append((id(self.autobucket_engine.engine), self.autobucket_engine._size))
            return output

    run = run_grpo(Counting, tmp_path / "async", eos_id, engine="async", **settings)
    assert [size for _, size in made] == [(4, 64), (4, 256)]  # prompts of 3 and 5 words, then 200 and 4
    assert made[0][0] != made[1][0]
    assert run.completions == run_grpo(AutobucketGRPOTrainer, tmp_path / "rollout", eos_id, **settings).completions


def test_bad_engine_choices_are_refused(tmp_path, eos_id):
    from datasets import Dataset

    with pytest.raises(ValueError, match=r"engine='vllm' is invalid: pass 'rollout' .* or 'async'"):
        AutobucketGRPOTrainer(
            model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0], engine="vllm",
            args=stock_trl_tests.grpo_config(tmp_path, greedy=True), processing_class=stock_trl_tests.word_tokenizer(eos_id),
            train_dataset=Dataset.from_dict({"prompt": stock_trl_tests.prompt_texts()}),
        )  # fmt: skip
    sharded = SimpleNamespace(
        accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3))),
        is_fsdp_enabled=False, processing_class=None,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"engine='async' with a sharded model \(FSDP or DeepSpeed ZeRO-3\)"):
        trl_async.TrainerEngine(None).runner(sharded, None, RolloutConfig())


def test_a_model_error_propagates_unchanged_and_leaves_the_engine_parked_and_usable(tiny_models):
    """The model's error reaches the caller as raised; the call's other requests are aborted (none stays
    in flight), the engine is parked again, and its next call generates what `Rollout.generate` does."""
    model = copy.deepcopy(tiny_models("tiny-qwen2"))
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None)), is_fsdp_enabled=False,
        processing_class=None, state=SimpleNamespace(global_step=0),
    )  # fmt: skip
    engines = trl_async.TrainerEngine(None)
    generate = engines.runner(trainer, model, RolloutConfig())
    runs, seeds, budgets = [([5, 6, 7], 2), ([9, 8], 1)], [11, 12], [6, 6]
    base = SamplingConfig(temperature=1.0, logprobs=True, eos_token_id=[])
    hook = model.model.layers[0].register_forward_hook(lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="^boom$"):
        generate(runs, seeds, budgets, base, {})
    hook.remove()
    engine = engines.engine
    assert engine.paused and engine.batch.requests == [] and engine._live == {}
    samples, [call] = generate(runs, seeds, budgets, base, {})
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    expected = rollout.generate([[5, 6, 7]], replace(base, n=2, max_new_tokens=6, seed=[11]))
    alone = rollout.generate([[9, 8]], replace(base, max_new_tokens=6, seed=[12]))
    assert samples == [*zip(expected.tokens[0], expected.logprobs[0], strict=True), (alone.tokens[0], alone.logprobs[0])]
    assert call.route == "async" and call.profile.output_tokens == 18
    engines.close()
    assert engines.engine is None and not engine._thread.is_alive()
