"""TRL's `GRPOTrainer` generating through autobucket (`pip install "autobucket[trl]"`, trl 1.16).

Two ways in, one generation function behind both (`trl_generation.generate_completions`):

- `AutobucketGRPOTrainer`: a `GRPOTrainer` whose non-vLLM generation (`_generate_single_turn`) runs
  `Rollout.generate`; everything else (dataloader, tokenisation, rewards, loss, optimizer) is TRL's.
- `make_rollout_func()`: for TRL's `rollout_func=` hook on a stock `GRPOTrainer`.

Why runs of identical prompts: TRL repeats every prompt `num_generations` times in a row before it
generates. Each run becomes one prompt with `SamplingConfig(n=run length)`, so it is prefilled once
and its KV shared by its samples. A run's stream key derives from (trainer seed, global step, process
index, generation call, run index), so a training run is reproducible and the sampled tokens do not
depend on the route or the batch plan.

Settings come from the trainer's `generation_config` (what TRL itself passes to `generate`).
Anything autobucket cannot honour raises a ValueError naming the option; nothing falls back silently.
Log-probabilities are returned when sampling: the trainer's (`log_softmax(logits / temperature)` over
the full vocabulary, `SamplingConfig.logprobs_mode="trainer"`, what TRL's loss computes); greedy
decoding returns None, as TRL's own path does.

Zero sampler-trainer mismatch (`rollout_config=RolloutConfig(kernels="invariant")`): the trainer's own
per-token logprob computation (`_get_per_token_logps_and_entropies`, for the loss, the old policy and
the reference model) runs its forward under `autobucket.invariant(model)`, with position ids counted
over real tokens as generation counts them (TRL's fused LM head counts them from column 0 of the
left-padded row and tiles the head's GEMM by batch size, so neither can equal a rollout bitwise).
`mismatch/k3` and `mismatch/max_abs_logp_diff` compare TRL's per-token logprobs of the loss with the
sampling logprobs on the weights that sampled them: they are logged for the micro-batches trained before
any optimizer step since their generation batch (the first of `num_iterations`; later iterations differ
by the policy's own change, which is not mismatch, and log nothing there), and are exactly 0 in fp32 and
bf16 (tests/integrations/test_integration_trl.py). A stock `GRPOTrainer` given
`make_rollout_func(RolloutConfig(kernels="invariant"))` gets the same scoring and metrics
(`trl_scoring.score_on_invariant_kernels`), but not the reuse below.
Being bitwise, where `AutobucketGRPOTrainer` sees TRL run a no-grad forward only for
`old_per_token_logps` (`num_iterations > 1` or `steps_per_generation > gradient_accumulation_steps`),
it returns the sampling logprobs instead and skips it (`reuse_sampling_logps=True`, the default;
counted in `autobucket_old_logps_reused`): only for single-turn batches (tool-result tokens carry
logprob 0.0), without active dropout or mixed-precision autocast; the loss and the final weights are
bitwise TRL's (benchmarks/studies/trl_old_logps.py times it).

Tool calling (`tools=` / `environment_factory=`): TRL's `_tool_call_loop` runs the tools and calls
`_generate_single_turn` again for each later turn, with prompt + completion + tool-result ids and
`num_generations=1`; those turns run through autobucket too, one sample per conversation (never merged
with an identical neighbour), each call with its own stream key. A conversation's next turn extends a
sequence the previous turn finished, so with `RolloutConfig(prefix_cache_mb > 0)` it prefills only the
tool-result tokens (`autobucket_turns[t][i].cached_prompt_tokens`, logged as
`autobucket/cached_prompt_tokens`). Without a `rollout_config`, a trainer with tools gets the default one
with `prefix_cache_mb=TOOL_PREFIX_CACHE_MB`; an explicit config is used as given (a warning says when its
cache is off). The cache lives for one generation batch only: it is emptied before and after each, so it
holds memory only while generating and never serves K/V of the weights before an optimizer step.
A later turn whose conversation leaves fewer than `max_completion_length` positions of the model's context
generates only what fits (TRL keeps no more than that of it).

Weight updates: the engine sees optimizer steps, fused ones included (they do not bump `_version`;
`engine/model_access/weight_versions.py` counts steps), but not writes through `.data` such as TRL's
reference-model sync; so the trainer also drops the rollout's packs and prefix cache and the trainer
scope's packs (`Rollout.refresh_weights()`) once per optimizer step."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from trl import GRPOTrainer

from autobucket import RolloutConfig
from autobucket.checks import optional_int
from autobucket.integrations.trl_async import TrainerEngine, checked_engine
from autobucket.integrations.trl_generation import (
    check_args_supported,
    check_trainer_supported,
    generate_completions,
    reject_multimodal,
)
from autobucket.integrations.trl_scoring import (
    invariant_per_token_logps,
    log_mismatch,
    mark_sampling_weights,
    needs_trl_forward,
    refresh_packs_once_per_step,
    score_on_invariant_kernels,
)

# Prefix cache of a trainer with tools and no rollout_config: one generation batch's conversations (it is
# emptied after every batch), least recently used evicted first beyond it.
TOOL_PREFIX_CACHE_MB = 1024.0


class AutobucketGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose completions come from `autobucket.Rollout`.

    rollout_config: how autobucket runs (default `RolloutConfig(route="auto")`; with tools, also
      `prefix_cache_mb=TOOL_PREFIX_CACHE_MB`, so tool turns prefill only their new tokens).
    continuous_batch_size: most completions decoded at once (None: the whole generation batch).
    reuse_sampling_logps: with invariant kernels, use the sampling logprobs as `old_per_token_logps`
      instead of TRL's extra forward (False: always run TRL's forward).
    engine: "rollout" (default: one `Rollout.generate` call per generation batch) or "async" (every
      completion a request on one `AsyncEngine` of the trainer's, parked outside generation and closed
      at the end of `train()`; `trl_async.py`); the same completions either way.
    Other arguments are `GRPOTrainer`'s; with `peft_config` it generates through the active LoRA adapter.

    After each generation batch: `autobucket_routes` (the routes of its last turn) and `autobucket_turns`
    (one list of `Profile`s per turn: the prompts, then each tool-calling iteration).

    Generation has eval semantics (no dropout), as TRL's vLLM path; TRL's own transformers path generates
    in train() mode, so with `lora_dropout > 0` the two agree only under `disable_dropout=True`.
    """

    def __init__(
        self,
        *args: Any,
        rollout_config: RolloutConfig | None = None,
        continuous_batch_size: int | None = None,
        reuse_sampling_logps: bool = True,
        engine: str = "rollout",
        **kwargs: Any,
    ) -> None:
        self.rollout_config = _rollout_config_or_default(rollout_config)
        self.reuse_sampling_logps = bool(reuse_sampling_logps)
        self.autobucket_old_logps_reused = 0  # generation batches whose old-policy forward was skipped
        self._autobucket_old_logps: tuple[list[list[int]], list[list[float]]] | None = None
        optional_int("continuous_batch_size", continuous_batch_size, 1, "or None for the whole generation batch")
        self.continuous_batch_size = continuous_batch_size
        self.autobucket_engine = TrainerEngine(continuous_batch_size) if checked_engine(engine) == "async" else None
        training_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        if training_args is not None:
            check_args_supported(training_args)  # before TRL builds a vLLM engine we would not use
        super().__init__(*args, **kwargs)
        check_trainer_supported(self)
        if self.autobucket_engine is not None:
            self.autobucket_engine.attach(self)
        self.autobucket_turns: list[list[Any]] = []
        self._autobucket_weights_step: int | None = None
        if self.tools and rollout_config is None:
            self.rollout_config = replace(self.rollout_config, prefix_cache_mb=TOOL_PREFIX_CACHE_MB)
        elif self.tools and not self.rollout_config.prefix_cache_mb and self.autobucket_engine is None:
            warnings.warn(
                "tools with rollout_config.prefix_cache_mb=0: every tool-calling turn prefills its whole "
                "conversation again; set RolloutConfig(prefix_cache_mb=...) to prefill only the new tokens",
                stacklevel=2,
            )

    @property
    def invariant_kernels(self) -> bool:
        return self.rollout_config.kernels == "invariant"

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        """TRL's per-token logprobs (and entropies); with invariant kernels the forward runs under
        `autobucket.invariant(model)`, so they are bitwise the rollout's for the same weights. TRL's
        old-policy call (no grad, right after generation) returns the sampling logprobs instead when
        `_generate` armed them (see `_old_logps_reusable`)."""
        self._refresh_after_optimizer_step()
        reused = self._take_sampling_logps(model, input_ids, logits_to_keep, compute_entropy, compute_aux_loss, multimodal)
        if reused is not None:
            return reused, None, None
        if not self.invariant_kernels or needs_trl_forward(compute_aux_loss, multimodal):
            logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal,
            )
        else:
            logps, entropies = invariant_per_token_logps(
                model, input_ids, attention_mask, logits_to_keep, self.temperature, batch_size, compute_entropy
            )
            aux_loss = None
        if torch.is_grad_enabled():
            self._autobucket_last_logps = logps.detach()  # the loss's logprobs, compared in _compute_loss
        return logps, entropies, aux_loss

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's training; the async engine (engine="async") is closed after it, its thread stopped."""
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.autobucket_engine is not None:
                self.autobucket_engine.close()

    def training_step(self, model, inputs, num_items_in_batch=None):
        """With invariant kernels the whole step runs in the scope: gradient checkpointing recomputes the
        forward during backward, and that recomputation must see the kernels the forward saw."""
        self._refresh_after_optimizer_step()
        if not self.invariant_kernels:
            return super().training_step(model, inputs, num_items_in_batch)
        from autobucket import invariant

        with invariant(self.model):
            return super().training_step(model, inputs, num_items_in_batch)

    def _compute_loss(self, model, inputs):
        """TRL's loss; logs the mismatch metrics when the loss ran on the weights that sampled the batch
        (`trl_scoring.log_mismatch`: the first iteration over a generation batch, not later ones)."""
        self._autobucket_last_logps = None
        loss = super()._compute_loss(model, inputs)
        log_mismatch(self, inputs, self._autobucket_last_logps)
        return loss

    def _refresh_after_optimizer_step(self) -> None:
        refresh_packs_once_per_step(self, self.invariant_kernels)

    def _generate(self, prompts):
        """TRL's generation batch (the prompts' turn, then its tool-calling turns). The prefix cache is
        emptied before and after it: its entries serve this batch's later turns only, so it holds memory
        only while generating and never outlives the weights it was filled under."""
        self._refresh_after_optimizer_step()
        self.autobucket_turns = []
        self._autobucket_old_logps = None
        mark_sampling_weights(self)
        self._forget_prefixes()
        try:
            output = super()._generate(prompts)
        finally:
            self._forget_prefixes()
        completion_ids_list, sampling_logps_list = output[1], output[4]
        if self._old_logps_reusable(sampling_logps_list):
            self._autobucket_old_logps = ([list(c) for c in completion_ids_list], sampling_logps_list)
        if self.rollout_config.prefix_cache_mb and self.autobucket_turns:
            mode = "train" if self.model.training else "eval"
            cached = sum(p.cached_prompt_tokens for turn in self.autobucket_turns for p in turn)
            self._metrics[mode]["autobucket/cached_prompt_tokens"].append(float(cached))
        return output

    def _generate_and_score_completions(self, inputs):
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._autobucket_old_logps = None  # armed for this generation batch's old-policy call only

    def _old_logps_reusable(self, sampling_logps_list: Any) -> bool:
        """Whether TRL's old-policy forward of this generation batch (it runs one when
        `gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0`, grpo_trainer.py
        `_generate_and_score_completions`) would return the sampling logprobs bitwise, so it can be skipped:
        invariant kernels, sampling (logprobs returned), one turn (tool-result tokens carry logprob 0.0,
        not the model's), no active dropout (TRL's forward runs in train mode, generation in eval), and no
        mixed-precision autocast (it changes the forward's kernels and output dtype). The weights are the
        sampling ones: the forward runs right after generation, before any optimizer step."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        if not (self.reuse_sampling_logps and self.invariant_kernels and sampling_logps_list is not None):
            return False
        if self.args.gradient_accumulation_steps % generate_every == 0 or self.use_vllm:
            return False
        if len(self.autobucket_turns) != 1 or self.accelerator.mixed_precision != "no":
            return False
        return not (self.model.training and _has_active_dropout(self.model))

    def _take_sampling_logps(
        self, model: Any, input_ids: torch.Tensor, logits_to_keep: int, compute_entropy: bool,
        compute_aux_loss: bool, multimodal: dict[str, Any],
    ) -> torch.Tensor | None:
        """The armed sampling logprobs as TRL's old-policy forward returns them ([B, logits_to_keep], the
        logits' dtype; positions past a completion hold 0.0, masked out of the loss as TRL's padding is),
        or None (run the forward) when this is not that call; the first no-grad policy call disarms them."""
        armed = self._autobucket_old_logps
        if armed is None or model is not self.model or torch.is_grad_enabled():
            return None
        self._autobucket_old_logps = None  # the first no-grad policy call only (a PEFT reference call follows)
        if compute_entropy or compute_aux_loss or any(v is not None for v in multimodal.values()):
            return None
        completions, logps = armed
        if input_ids.shape[0] != len(completions) or any(len(c) > logits_to_keep for c in completions):
            return None
        tail = input_ids[:, input_ids.shape[1] - logits_to_keep :].tolist()
        if any(row[: len(c)] != c for row, c in zip(tail, completions, strict=True)):
            return None  # not this batch's completions: run the forward
        out = torch.zeros(len(logps), logits_to_keep, dtype=torch.float32)
        for row, values in enumerate(logps):
            out[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        self.autobucket_old_logps_reused += 1
        return out.to(device=input_ids.device, dtype=_logits_dtype(model))

    def _forget_prefixes(self) -> None:
        cached = getattr(self, "_autobucket_rollout", None)
        if cached is not None and cached[2].prefix_cache is not None:
            cached[2].prefix_cache.clear()

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        """TRL 1.16's generation hook: prompt id lists (each repeated `num_generations` times in a row)
        -> (completion ids, per-token logprobs or None). TRL's tool loop calls it again for each later turn
        with prompt + completion + tool-result ids and `num_generations=1` (one sample per conversation)."""
        reject_multimodal(images, multimodal_fields)
        continued = bool(self.autobucket_turns)  # a tool-calling turn of this generation batch
        runner = self.autobucket_engine.runner if self.autobucket_engine is not None else None
        completions, logprobs = generate_completions(  # positional: tests wrap it as (trainer, *args)
            self, prompt_ids, self.rollout_config, self.continuous_batch_size, num_generations, continued, runner
        )
        self.autobucket_turns.append(self.autobucket_profiles)
        return completions, logprobs


def _has_active_dropout(model: Any) -> bool:
    """A dropout module with p > 0 (attention dropout the invariant kernels refuse in train mode)."""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def _logits_dtype(model: Any) -> torch.dtype:
    """The dtype of the model's logits (its LM head's weights; no autocast: `_old_logps_reusable`)."""
    from autobucket.engine.model_access.hf_compat import unwrap_model

    head = unwrap_model(model).get_output_embeddings()
    return head.weight.dtype if head is not None else torch.float32


def make_rollout_func(
    rollout_config: RolloutConfig | None = None, continuous_batch_size: int | None = None
) -> Callable[[list, Any], dict[str, Any]]:
    """A function for `GRPOTrainer(rollout_func=...)` that generates with autobucket.

    It tokenises prompts exactly as the trainer's own path does (chat template for conversational
    prompts) and returns `prompt_ids`, `completion_ids` and `logprobs`.

    With `kernels="invariant"`, its first call also makes the trainer's scoring the invariant one
    (`trl_scoring.score_on_invariant_kernels`: TRL's per-token logprob forward replaced on that trainer
    instance, its training step inside `autobucket.invariant(model)`), so the loss's logprobs are
    bitwise the sampling ones, and the trainer logs `mismatch/k3` and `mismatch/max_abs_logp_diff` for
    each micro-batch trained on the weights that sampled it. The training step already running at that
    first call computes its loss without gradient checkpointing (its backward runs outside the scope).
    """
    config = _rollout_config_or_default(rollout_config)

    def rollout_func(prompts: list, trainer: Any) -> dict[str, Any]:
        check_trainer_supported(trainer)
        if getattr(trainer, "tools", None) and not isinstance(trainer, AutobucketGRPOTrainer):
            raise ValueError(
                "tools with make_rollout_func() are not supported: TRL's tool loop would generate every turn "
                "after the first with its own backend, not autobucket; use AutobucketGRPOTrainer(tools=...)"
            )
        _score_as_configured(trainer, config)
        prompt_ids, images, multimodal_fields = trainer._tokenize_prompts(prompts)
        reject_multimodal(images, multimodal_fields)
        completion_ids, logprobs = generate_completions(trainer, prompt_ids, config, continuous_batch_size)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return rollout_func


def _score_as_configured(trainer: Any, config: RolloutConfig) -> None:
    """Before a rollout function's generation batch: note the sampling weights, and with invariant
    kernels make the trainer's scoring invariant (an `AutobucketGRPOTrainer` scores as its own
    rollout_config says, so the two must agree)."""
    if isinstance(trainer, AutobucketGRPOTrainer):
        if trainer.invariant_kernels != (config.kernels == "invariant"):
            raise ValueError(
                f"make_rollout_func(RolloutConfig(kernels={config.kernels!r})) on an AutobucketGRPOTrainer whose "
                f"rollout_config has kernels={trainer.rollout_config.kernels!r}: the trainer scores completions as "
                "its own rollout_config says; pass the same kernels to both (or drop rollout_func)"
            )
        return  # its _generate marks the sampling weights
    mark_sampling_weights(trainer)
    if config.kernels == "invariant":
        score_on_invariant_kernels(trainer)


def _rollout_config_or_default(config: RolloutConfig | None) -> RolloutConfig:
    if config is None:
        return RolloutConfig(route="auto")
    if not isinstance(config, RolloutConfig):
        raise ValueError(
            f"rollout_config={config!r} is invalid: pass an autobucket RolloutConfig (e.g. RolloutConfig(route='auto'))"
        )
    return config
