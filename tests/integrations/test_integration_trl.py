"""autobucket inside TRL's real GRPO trainer (trl 1.16): its dataloader, tokenisation, EOS masking,
rewards, loss and optimizer run unchanged; only generation differs.

Oracles: the stock `GRPOTrainer` (greedy: identical completions, logged lengths and final weights on
every route), the ordinary route (sampling: bit-identical on the other routes, route-invariant
streams), and TRL's own recomputed `old_per_token_logps` (returned logprobs within 1e-5). A different
trainer seed must change the sampled completions (negative control for the sampling comparison)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

import torch  # noqa: E402
from byte_tokenizer import byte_bpe_tokenizer, corpus_piece  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from workloads import VOCAB, firing_eos_candidates  # noqa: E402

from autobucket import RolloutConfig  # noqa: E402
from autobucket.integrations.trl import AutobucketGRPOTrainer, make_rollout_func  # noqa: E402
from autobucket.models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT_WORDS = (300, 4, 7, 3)  # one long prompt and several short ones: auto chooses bucketed CB
NUM_GENERATIONS = 2
MAX_COMPLETION = 10


def word_tokenizer(eos_id: int):
    """An in-memory word-level tokenizer over the tiny model's vocabulary: id i <-> "w{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token=f"w{eos_id}" if eos_id > 2 else "</s>"
    )


def prompt_texts(lengths=PROMPT_WORDS, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(n)) for n in lengths]


@pytest.fixture(scope="module")
def eos_id() -> int:
    """A token greedy decoding emits mid-completion for some prompts only, so EOS masking is exercised."""
    model, tokenizer = build_tiny_model("tiny-qwen2"), word_tokenizer(2)
    outputs = []
    for text in prompt_texts():
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_COMPLETION, do_sample=False)
        outputs.append(out[0, ids.shape[1] :].tolist())
    candidates = firing_eos_candidates(outputs)
    assert candidates, "no token ends some greedy completions but not all: change the prompts"
    return candidates[0]


@dataclass
class Run:
    completions: list  # per generation call: completion id lists, in TRL's row order
    logged_lengths: list  # per step: (mean, min, max) completion length as TRL logged it
    weights: dict
    outputs: list  # per generation call: TRL's output dict
    routes: list  # the routes autobucket ran for the last batch (None: TRL generated)
    log_history: list  # TRL's logged metrics, one dict per logging step
    losses: list  # per loss call, what `recording_loss_logps` kept (empty for other trainer classes)


def grpo_config(tmp_path, greedy: bool, **overrides) -> GRPOConfig:
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=len(PROMPT_WORDS) * NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION, max_steps=3, learning_rate=0.05,
        logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
        shuffle_dataset=False, temperature=1.0, top_k=0, top_p=1.0, dataloader_num_workers=0,
    )
    if greedy:  # identical samples give zero advantages: the entropy bonus still moves the weights
        settings.update(generation_kwargs={"do_sample": False}, entropy_coef=0.5)
    settings.update(overrides)
    return GRPOConfig(**settings)


def recording(trainer_cls):
    """`trainer_cls` that also keeps each generation batch's output dict."""

    class Recording(trainer_cls):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.recorded_outputs = [*getattr(self, "recorded_outputs", []), output]
            return output

    return Recording


def run_grpo(
    trainer_cls, tmp_path, eos_id, greedy=True, texts=None, config_overrides=None, dtype=torch.float32,
    tokenizer=None, model_generation=None, **trainer_kwargs,
) -> Run:
    model, tokenizer = build_tiny_model("tiny-qwen2").to(dtype), tokenizer or word_tokenizer(eos_id)
    for key, value in (model_generation or {}).items():  # the model's own generation_config
        setattr(model.generation_config, key, value)
    completions: list = []

    def toy_reward(completion_ids, **kwargs):  # also records what TRL scored
        completions.append([list(ids) for ids in completion_ids])
        return [float(len(set(ids)) + sum(ids) % 5) for ids in completion_ids]

    trainer = recording(trainer_cls)(
        model=model, reward_funcs=toy_reward, args=grpo_config(tmp_path, greedy, **(config_overrides or {})),
        train_dataset=Dataset.from_dict({"prompt": texts or prompt_texts()}), processing_class=tokenizer,
        **trainer_kwargs,
    )
    trainer.train()
    logged = [
        tuple(h[f"completions/{k}_length"] for k in ("mean", "min", "max"))
        for h in trainer.state.log_history if "completions/mean_length" in h
    ]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Run(
        completions, logged, weights, trainer.recorded_outputs, getattr(trainer, "autobucket_routes", None),
        trainer.state.log_history, getattr(trainer, "recorded_losses", []),
    )


def assert_same_training(got: Run, want: Run) -> None:
    assert got.completions == want.completions
    assert got.logged_lengths == want.logged_lengths
    different = [k for k in want.weights if not torch.equal(got.weights[k], want.weights[k])]
    assert not different, f"final weights differ in {different[:3]}"


@pytest.fixture(scope="module")
def stock_greedy(tmp_path_factory, eos_id) -> Run:
    run = run_grpo(GRPOTrainer, tmp_path_factory.mktemp("stock"), eos_id)
    initial = build_tiny_model("tiny-qwen2").state_dict()
    assert len(run.completions) == 3 and len(run.logged_lengths) == 3
    assert any(not torch.equal(run.weights[k], initial[k]) for k in initial), "training did not move the weights"
    assert len({tuple(map(tuple, c)) for c in run.completions}) > 1, "completions never changed across steps"
    ended = [ids for call in run.completions for ids in call if ids[-1] == eos_id]
    assert ended and any(len(ids) == MAX_COMPLETION and ids[-1] != eos_id for c in run.completions for ids in c)
    return run


@pytest.mark.parametrize("route", ["ordinary", "equal_width", "aligned", "auto"])
def test_greedy_grpo_matches_stock_trainer(route, stock_greedy, tmp_path, eos_id):
    run = run_grpo(AutobucketGRPOTrainer, tmp_path, eos_id, rollout_config=RolloutConfig(route=route))
    assert run.routes == [{"auto": "bucketed"}.get(route, route)]
    assert_same_training(run, stock_greedy)
    assert all(output.get("sampling_per_token_logps") is None for output in run.outputs)  # greedy: as TRL's path


def test_rollout_func_matches_stock_trainer(stock_greedy, tmp_path, eos_id):
    run = run_grpo(GRPOTrainer, tmp_path, eos_id, rollout_func=make_rollout_func(RolloutConfig(route="aligned")))
    assert_same_training(run, stock_greedy)


@pytest.fixture(scope="module")
def sampled_ordinary(tmp_path_factory, eos_id) -> Run:
    return run_grpo(
        AutobucketGRPOTrainer, tmp_path_factory.mktemp("ordinary"), eos_id, greedy=False,
        rollout_config=RolloutConfig(route="ordinary"),
    )


@pytest.mark.parametrize("route", ["auto", "aligned"])
def test_sampled_grpo_is_route_invariant(route, sampled_ordinary, tmp_path, eos_id):
    run = run_grpo(
        AutobucketGRPOTrainer, tmp_path, eos_id, greedy=False, rollout_config=RolloutConfig(route=route)
    )
    # auto must really run bucketed CB here, or this would compare the ordinary route with itself
    assert run.routes == [{"auto": "bucketed"}.get(route, route)] and sampled_ordinary.routes == ["ordinary"]
    samples = [ids for call in run.completions for ids in call]
    assert len({tuple(ids) for ids in samples}) > len(samples) // 2, "sampling produced mostly duplicates"
    assert_same_training(run, sampled_ordinary)


def test_sampled_grpo_depends_on_trainer_seed(sampled_ordinary, tmp_path, eos_id):
    run = run_grpo(
        AutobucketGRPOTrainer, tmp_path, eos_id, greedy=False, config_overrides={"seed": 1},
        rollout_config=RolloutConfig(route="ordinary"),
    )
    assert run.completions[0] != sampled_ordinary.completions[0]


def test_logprobs_match_trl_recomputed(tmp_path, eos_id):
    # num_iterations=2 makes TRL recompute old_per_token_logps with a training-mode forward
    run = run_grpo(
        AutobucketGRPOTrainer, tmp_path, eos_id, greedy=False, config_overrides={"num_iterations": 2},
        rollout_config=RolloutConfig(route="auto"),
    )
    assert run.outputs
    for output in run.outputs:
        mask = output["completion_mask"].bool()
        ours, trl = output["sampling_per_token_logps"][mask], output["old_per_token_logps"][mask]
        assert mask.sum() >= len(PROMPT_WORDS) * NUM_GENERATIONS
        # different forward shapes (bucketed prefill vs TRL's padded batch) leave fp32 rounding only
        torch.testing.assert_close(ours, trl, rtol=1e-5, atol=1e-5)
        assert (ours - trl).abs().median() < 2e-6


# ------------------------------------------------------------------ zero sampler-trainer mismatch
def logged_mismatch(run: Run) -> list[tuple[float, float]]:
    return [(h["mismatch/k3"], h["mismatch/max_abs_logp_diff"]) for h in run.log_history if "mismatch/k3" in h]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_invariant_kernels_give_zero_mismatch_every_step(tmp_path, eos_id, dtype):
    """TRL's own per-token logprobs (its loss path, under autobucket.invariant) equal the sampling
    logprobs bitwise at every step; the oracle is TRL's recomputation itself (logged k3 and max |diff|),
    and also the recorded tensors. Control: the default kernels log a non-zero mismatch on the same run."""
    config = {"num_generations": 4, "per_device_train_batch_size": len(PROMPT_WORDS) * 4}
    run = run_grpo(
        AutobucketGRPOTrainer, tmp_path, eos_id, greedy=False, config_overrides=config, dtype=dtype,
        rollout_config=RolloutConfig(route="auto", kernels="invariant"),
    )
    assert logged_mismatch(run) == [(0.0, 0.0)] * 3
    control = run_grpo(
        AutobucketGRPOTrainer, tmp_path, eos_id, greedy=False, config_overrides=config, dtype=dtype,
        rollout_config=RolloutConfig(route="auto"),
    )
    assert len(logged_mismatch(control)) == 3 and max(diff for _, diff in logged_mismatch(control)) > 0.0


def recording_loss_logps(trainer_cls):
    """`trainer_cls` (an AutobucketGRPOTrainer) that also keeps, per loss call, the optimizer step it ran at
    and the loss's logprobs, sampling logprobs and completion mask."""

    class RecordingLoss(trainer_cls):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            record = (self.state.global_step, self._autobucket_last_logps, inputs["sampling_per_token_logps"],
                      inputs["completion_mask"])  # fmt: skip
            self.recorded_losses = [*getattr(self, "recorded_losses", []), record]
            return loss

    return RecordingLoss


@pytest.mark.parametrize(
    ("kernels", "dtype"),
    [("invariant", torch.float32), ("invariant", torch.bfloat16), ("hf", torch.float32)],
    ids=["invariant-fp32", "invariant-bf16", "hf-fp32"],
)
def test_mismatch_is_logged_on_the_weights_that_sampled(tmp_path, eos_id, kernels, dtype):
    """num_iterations=2 at a large learning rate: the second pass over a generation batch runs after an
    optimizer step, so its loss's logprobs differ from the sampling ones by the policy's change (the
    control: k3 of that pass is large, what mismatch/k3 reported before). mismatch/* is logged for the
    first pass only, on the sampling weights: exactly 0 with invariant kernels, rounding with HF's."""
    from autobucket.engine.trainer_logprobs import mismatch_metrics

    config = {"num_iterations": 2, "max_steps": 4}
    run = run_grpo(
        recording_loss_logps(AutobucketGRPOTrainer), tmp_path, eos_id, greedy=False, config_overrides=config,
        dtype=dtype, rollout_config=RolloutConfig(route="auto", kernels=kernels),
    )
    logged_steps = [h["step"] for h in run.log_history if "mismatch/k3" in h]
    assert logged_steps == [1, 3]  # the generation batches at optimizer steps 0 and 2, each first pass
    if kernels == "invariant":
        assert logged_mismatch(run) == [(0.0, 0.0)] * 2
    else:
        assert all(0.0 < diff < 1e-4 for _, diff in logged_mismatch(run))
    drift = [mismatch_metrics(*record[1:])["mismatch/k3"] for record in run.losses if record[0] % 2 == 1]
    assert len(drift) == 2 and min(drift) > 1e-3  # second passes: drift, not logged as mismatch


# ------------------------------------------------------------------ the stock trainer with make_rollout_func
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rollout_func_with_invariant_kernels_scores_bitwise(tmp_path, eos_id, dtype, monkeypatch):
    """A stock GRPOTrainer given make_rollout_func(kernels="invariant"): TRL's old-policy logprobs
    (num_iterations=2 makes TRL compute them with its scoring forward) equal the sampling logprobs bitwise,
    and mismatch/* is logged, exactly 0, once per generation batch. Oracle for the whole training: the
    AutobucketGRPOTrainer with invariant kernels and TRL's forward kept (reuse off) gives the same
    completions and bitwise the same weights. Control: TRL's own scoring (the install skipped) differs."""
    import autobucket.integrations.trl as integration

    config = {"num_iterations": 2, "max_steps": 4}
    rollout = RolloutConfig(route="auto", kernels="invariant")
    stock = run_grpo(
        GRPOTrainer, tmp_path, eos_id, greedy=False, config_overrides=config, dtype=dtype,
        rollout_func=make_rollout_func(rollout),
    )
    assert logged_mismatch(stock) == [(0.0, 0.0)] * 2
    for output in stock.outputs:
        mask = output["completion_mask"].bool()
        assert mask.sum() > 0 and output["old_per_token_logps"].dtype == dtype
        assert torch.equal(output["old_per_token_logps"][mask], output["sampling_per_token_logps"][mask].to(dtype))
    ours = run_grpo(
        AutobucketGRPOTrainer, tmp_path, eos_id, greedy=False, config_overrides=config, dtype=dtype,
        rollout_config=rollout, reuse_sampling_logps=False,
    )
    assert_same_training(stock, ours)
    monkeypatch.setattr(integration, "score_on_invariant_kernels", lambda trainer: None)
    trl_scored = run_grpo(
        GRPOTrainer, tmp_path, eos_id, greedy=False, config_overrides=config, dtype=dtype,
        rollout_func=make_rollout_func(rollout),
    )
    assert logged_mismatch(trl_scored) == []
    output = trl_scored.outputs[0]
    mask = output["completion_mask"].bool()
    assert not torch.equal(output["old_per_token_logps"][mask], output["sampling_per_token_logps"][mask].to(dtype))


def test_rollout_func_kernels_must_agree_with_the_autobucket_trainer(tmp_path, eos_id):
    trainer = AutobucketGRPOTrainer(
        model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0], args=grpo_config(tmp_path, False),
        train_dataset=Dataset.from_dict({"prompt": prompt_texts()}), processing_class=word_tokenizer(eos_id),
    )  # fmt: skip
    rollout_func = make_rollout_func(RolloutConfig(kernels="invariant"))
    with pytest.raises(ValueError, match=r"kernels='invariant'\)\) on an AutobucketGRPOTrainer whose rollout_config"):
        rollout_func(prompt_texts(), trainer)
    assert trainer.autobucket_turns == [] and getattr(trainer, "autobucket_routes", None) is None  # nothing ran


# ------------------------------------------------------------------ sampling options
def tokens_outside_min_p(outputs, min_p: float) -> int:
    """Completion tokens of the first generation call that HF's MinPLogitsWarper (on a teacher-forced
    forward of the initial model; the run's temperature 1.0, top_k 0, top_p 1.0 change nothing) filters."""
    from transformers import MinPLogitsWarper

    model, output, outside = build_tiny_model("tiny-qwen2"), outputs[0], 0
    for row in range(output["prompt_ids"].shape[0]):
        prompt = output["prompt_ids"][row][output["prompt_mask"][row].bool()].tolist()
        completion = output["completion_ids"][row][output["completion_mask"][row].bool()].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
        kept = torch.isfinite(MinPLogitsWarper(min_p)(None, logits))  # [steps, vocab]
        outside += int((~kept[torch.arange(len(completion)), torch.tensor(completion)]).sum())
    return outside


def test_min_p_is_applied(tmp_path, eos_id):
    run = run_grpo(AutobucketGRPOTrainer, tmp_path, eos_id, greedy=False, config_overrides={"min_p": 0.1, "max_steps": 1})
    assert run.outputs[0]["completion_mask"].sum() >= len(PROMPT_WORDS) * NUM_GENERATIONS
    assert tokens_outside_min_p(run.outputs, 0.1) == 0
    # negative control: sampling without min_p leaves its kept set
    unwarped = run_grpo(AutobucketGRPOTrainer, tmp_path, eos_id, greedy=False, config_overrides={"max_steps": 1})
    assert tokens_outside_min_p(unwarped.outputs, 0.1) > 0


def test_generation_kwargs_warpers_map_to_sampling_config(tmp_path, eos_id):
    from transformers import GenerationConfig

    from autobucket.integrations.trl_generation import sampling_from_generation_config

    warpers = {"typical_p": 0.9, "epsilon_cutoff": 1e-3, "eta_cutoff": 2e-3}
    trainer = AutobucketGRPOTrainer(
        model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0],
        args=grpo_config(tmp_path, greedy=False, min_p=0.05, generation_kwargs=warpers),
        train_dataset=Dataset.from_dict({"prompt": prompt_texts()}), processing_class=word_tokenizer(eos_id),
    )
    sampling = sampling_from_generation_config(trainer.generation_config, trainer.eos_token_ids)
    assert {k: getattr(sampling, k) for k in ("min_p", *warpers)} == {"min_p": 0.05, **warpers}
    # values transformers would not apply (typical_p 1, cutoffs outside (0, 1)) are off here too
    inert = GenerationConfig(do_sample=True, max_new_tokens=4, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=1.0)
    sampling = sampling_from_generation_config(inert, [eos_id])
    assert (sampling.min_p, sampling.typical_p, sampling.epsilon_cutoff, sampling.eta_cutoff) == (0.0, 1.0, 0.0, 0.0)


def test_generation_kwargs_stop_strings_end_completions_as_the_rollout_does(tmp_path):
    """generation_kwargs={"stop_strings": [...]} (which the stock trainer's transformers path cannot run: it
    passes generate no tokenizer) end completions where `Rollout.generate` with the same strings does, matched
    with the trainer's tokenizer; the strings fire (else the comparison could not fail)."""
    from autobucket import Rollout, SamplingConfig

    tokenizer = byte_bpe_tokenizer()
    rng = random.Random(3)
    texts = [tokenizer.decode([rng.randrange(259, VOCAB) for _ in range(n)]) for n in (12, 5, 30, 8)]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    free = Rollout(build_tiny_model("tiny-qwen2"), tokenizer).generate(
        prompts, SamplingConfig(max_new_tokens=MAX_COMPLETION, eos_token_id=[tokenizer.eos_token_id])
    )
    strings = [corpus_piece(tokenizer.decode(tokens), 3, 2) for tokens in free.tokens[:3]]
    expected = Rollout(build_tiny_model("tiny-qwen2"), tokenizer).generate(
        prompts,
        SamplingConfig(max_new_tokens=MAX_COMPLETION, eos_token_id=[tokenizer.eos_token_id], stop_strings=strings),
    )
    assert expected.finish_reasons.count("stop") >= 2, (strings, expected.finish_reasons)
    run = run_grpo(
        AutobucketGRPOTrainer, tmp_path, tokenizer.eos_token_id, texts=texts, tokenizer=tokenizer,
        config_overrides={"generation_kwargs": {"do_sample": False, "stop_strings": strings}, "max_steps": 1},
    )  # fmt: skip
    assert run.completions[0] == [tokens for tokens in expected.tokens for _ in range(NUM_GENERATIONS)]


def test_generation_kwargs_min_new_tokens_match_the_stock_trainer(stock_greedy, tmp_path, eos_id):
    """generation_kwargs={"min_new_tokens": k}: the stock trainer's `generate` applies it, and so does
    autobucket (it was refused before); k is past the first step's earliest EOS, so completions change."""
    ended = [len(ids) for ids in stock_greedy.completions[0] if ids[-1] == eos_id]
    minimum = min(ended) + 1
    overrides = {"generation_kwargs": {"do_sample": False, "min_new_tokens": minimum}, "max_steps": 1}
    stock = run_grpo(GRPOTrainer, tmp_path / "stock", eos_id, config_overrides=overrides)
    ours = run_grpo(AutobucketGRPOTrainer, tmp_path / "ours", eos_id, config_overrides=overrides)
    assert ours.completions == stock.completions != stock_greedy.completions[:1]
    assert min(len(ids) for ids in ours.completions[0]) >= minimum


def test_the_models_own_min_new_tokens_apply_as_in_the_stock_trainer(stock_greedy, tmp_path, eos_id):
    """What TRL's GenerationConfig leaves unset, its `generate` takes from the model's generation_config
    (transformers 5.x fills None fields; on 4.57 TRL overlays its kwargs on a copy of the model's), so a
    model's own min_new_tokens applies in the stock trainer; autobucket applies it too (it was read as 0)."""
    ended = [len(ids) for ids in stock_greedy.completions[0] if ids[-1] == eos_id]
    minimum = min(ended) + 1
    settings = dict(config_overrides={"generation_kwargs": {"do_sample": False}, "max_steps": 1},
                    model_generation={"min_new_tokens": minimum})  # fmt: skip
    stock = run_grpo(GRPOTrainer, tmp_path / "stock", eos_id, **settings)
    ours = run_grpo(AutobucketGRPOTrainer, tmp_path / "ours", eos_id, **settings)
    assert ours.completions == stock.completions != stock_greedy.completions[:1]


# ------------------------------------------------------------------ bad input
def test_unsupported_generation_option_is_rejected(tmp_path, eos_id):
    with pytest.raises(ValueError, match=r"top_h=0\.5, which autobucket cannot apply"):
        AutobucketGRPOTrainer(
            model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0],
            args=grpo_config(tmp_path, greedy=False, generation_kwargs={"top_h": 0.5}),
            train_dataset=Dataset.from_dict({"prompt": prompt_texts()}), processing_class=word_tokenizer(eos_id),
        )
    with pytest.raises(ValueError, match=r"min_p=1\.5 is invalid: it must be in \[0, 1\]"):
        AutobucketGRPOTrainer(
            model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0],
            args=grpo_config(tmp_path, greedy=False, min_p=1.5),
            train_dataset=Dataset.from_dict({"prompt": prompt_texts()}), processing_class=word_tokenizer(eos_id),
        )


@pytest.mark.parametrize("name", ["no_repeat_ngram_size", "suppress_tokens", "bad_words_ids"])
def test_generation_kwargs_logits_processors_match_the_stock_trainer(stock_greedy, tmp_path, eos_id, name):
    """generation_kwargs the stock trainer's `generate` applies through logits processors (refused before):
    autobucket applies them per sequence, with the same completions; each value is taken from the stock
    trainer's own greedy completions, so it changes them (else the test could not fail)."""
    first = stock_greedy.completions[0]
    value = {"no_repeat_ngram_size": 1, "suppress_tokens": [first[0][0]], "bad_words_ids": [[first[-1][1]]]}[name]
    overrides = {"generation_kwargs": {"do_sample": False, name: value}, "max_steps": 1}
    stock = run_grpo(GRPOTrainer, tmp_path / "stock", eos_id, config_overrides=overrides)
    ours = run_grpo(AutobucketGRPOTrainer, tmp_path / "ours", eos_id, config_overrides=overrides)
    assert ours.completions == stock.completions != stock_greedy.completions[:1]


@pytest.mark.parametrize("option", [{"min_length": 30}, {"forced_eos_token_id": 7}])
def test_generation_kwargs_autobucket_cannot_apply_are_refused_not_ignored(tmp_path, eos_id, option):
    """The stock trainer's `generate` applies these; generating without them would silently give other
    completions (each ran, ignored, before), so both ways in refuse them by name (min_length: the stock
    trainer counts each prompt's left padding toward it)."""
    (name, value), = option.items()
    config = grpo_config(tmp_path, greedy=True, generation_kwargs={"do_sample": False, **option})
    message = rf"generation option {name}={re.escape(repr(value))} \(GRPOConfig.generation_kwargs\) is not supported"
    with pytest.raises(ValueError, match=message):
        AutobucketGRPOTrainer(
            model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0], args=config,
            train_dataset=Dataset.from_dict({"prompt": prompt_texts()}), processing_class=word_tokenizer(eos_id),
        )  # fmt: skip
    stock = GRPOTrainer(
        model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0] * len(kw["completion_ids"]), args=config,
        train_dataset=Dataset.from_dict({"prompt": prompt_texts()}), processing_class=word_tokenizer(eos_id),
        rollout_func=make_rollout_func(RolloutConfig(route="aligned")),
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        stock.train()


def test_an_eos_override_in_generation_kwargs_is_refused(tmp_path, eos_id):
    """The stock trainer stops at generation_kwargs' eos_token_id but masks completions by its own EOS ids
    (the model's and the tokenizer's), so a completion that stops there runs on as padding; autobucket
    generated past it instead (silently other completions): now refused, naming where the EOS belongs."""
    config = grpo_config(tmp_path, greedy=True, generation_kwargs={"do_sample": False, "eos_token_id": 900})
    with pytest.raises(ValueError, match=r"eos_token_id=900 .* differs from the trainer's eos_token_ids"):
        AutobucketGRPOTrainer(
            model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0], args=config,
            train_dataset=Dataset.from_dict({"prompt": prompt_texts()}), processing_class=word_tokenizer(eos_id),
        )  # fmt: skip


def test_vllm_mode_is_rejected(tmp_path, eos_id):
    with pytest.raises(ValueError, match="use_vllm=True is not supported"):
        AutobucketGRPOTrainer(
            model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0],
            args=grpo_config(tmp_path, greedy=True, use_vllm=True),
        )


def test_prompt_longer_than_context_is_rejected(tmp_path, eos_id):
    texts = prompt_texts((2045, 4, 7, 3))  # tiny-qwen2 has 2048 positions; +10 new tokens does not fit
    with pytest.raises(ValueError, match=r"prompt 0 has 2045 tokens; with max_completion_length=10"):
        run_grpo(AutobucketGRPOTrainer, tmp_path, eos_id, texts=texts)


def test_empty_batch_and_images_are_rejected(tmp_path, eos_id):
    trainer = AutobucketGRPOTrainer(
        model=build_tiny_model("tiny-qwen2"), reward_funcs=lambda **kw: [0.0], args=grpo_config(tmp_path, True),
        train_dataset=Dataset.from_dict({"prompt": prompt_texts()}), processing_class=word_tokenizer(eos_id),
    )
    with pytest.raises(ValueError, match="the generation batch is empty"):
        trainer._generate_single_turn([], None, {}, NUM_GENERATIONS)
    with pytest.raises(ValueError, match="prompts with images are not supported"):
        trainer._generate_single_turn([[5, 6], [5, 6]], [["an image"], ["an image"]], {}, NUM_GENERATIONS)
    with pytest.raises(ValueError, match=r"multimodal processor fields \['pixel_values'\]"):
        trainer._generate_single_turn([[5, 6], [5, 6]], None, {"pixel_values": [0]}, NUM_GENERATIONS)


def test_zero3_without_gathering_is_rejected(tmp_path):
    from types import SimpleNamespace

    from autobucket.integrations.trl_generation import check_trainer_supported

    args = grpo_config(tmp_path, greedy=True, ds3_gather_for_generation=False)
    trainer = SimpleNamespace(
        args=args, accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3))),
    )
    with pytest.raises(ValueError, match="ds3_gather_for_generation=False is not supported"):
        check_trainer_supported(trainer)


# ------------------------------------------------------------------ old-policy logprobs from the rollout
def counting_policy_forwards(monkeypatch) -> list[int]:
    """Counts the trainer's no-grad invariant forwards (TRL's old-policy and reference logprobs)."""
    import autobucket.integrations.trl as integration

    calls, original = [], integration.invariant_per_token_logps

    def counted(*args, **kwargs):
        if not torch.is_grad_enabled():
            calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(integration, "invariant_per_token_logps", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_invariant_kernels_reuse_sampling_logps_as_old_policy(tmp_path, eos_id, dtype, monkeypatch):
    """num_iterations=2: TRL runs a no-grad forward per generation batch only for old_per_token_logps.
    With invariant kernels the trainer skips it and uses the sampling logprobs; the oracle is the same
    run with the reuse off (TRL's own forward): the same old_per_token_logps on every completion token
    (bitwise, same dtype), the same logged losses and bitwise the same final weights."""
    config = {"num_iterations": 2}
    rollout = RolloutConfig(route="auto", kernels="invariant")
    calls = counting_policy_forwards(monkeypatch)
    reused = run_grpo(
        AutobucketGRPOTrainer, tmp_path, eos_id, greedy=False, config_overrides=config, dtype=dtype,
        rollout_config=rollout,
    )
    reused_forwards, calls[:] = len(calls), []
    stock = run_grpo(
        AutobucketGRPOTrainer, tmp_path, eos_id, greedy=False, config_overrides=config, dtype=dtype,
        rollout_config=rollout, reuse_sampling_logps=False,
    )
    assert len(stock.outputs) == len(reused.outputs) == 2  # steps 0 and 2 generate (generate_every = 2)
    assert reused_forwards == 0 and len(calls) == len(stock.outputs)  # TRL's forward ran once per batch
    for got, want in zip(reused.outputs, stock.outputs, strict=True):
        mask = want["completion_mask"].bool()
        assert torch.equal(got["completion_ids"], want["completion_ids"]) and mask.sum() > 0
        assert got["old_per_token_logps"].dtype == want["old_per_token_logps"].dtype == dtype
        assert torch.equal(got["old_per_token_logps"][mask], want["old_per_token_logps"][mask])
    losses = [[h["loss"] for h in run.log_history if "loss" in h] for run in (reused, stock)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    assert_same_training(reused, stock)


def test_hf_kernels_keep_trl_old_policy_forward(tmp_path, eos_id, monkeypatch):
    """Negative control: with the default kernels the sampling logprobs are not TRL's bitwise, so the
    old-policy forward runs (its logprobs differ from the sampling ones somewhere)."""
    from autobucket.integrations.trl import AutobucketGRPOTrainer as Trainer

    forwards = []
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def counted(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            forwards.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", counted)
    run = run_grpo(
        Trainer, tmp_path, eos_id, greedy=False, config_overrides={"num_iterations": 2},
        rollout_config=RolloutConfig(route="auto"),
    )
    assert len(forwards) == len(run.outputs) == 2
    diffs = [
        (o["old_per_token_logps"] - o["sampling_per_token_logps"])[o["completion_mask"].bool()].abs().max()
        for o in run.outputs
    ]
    assert max(diffs) > 0.0
