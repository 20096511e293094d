"""The trainer's half of zero sampler-trainer mismatch in TRL: its per-token logprobs on the invariant
kernels, and the mismatch metric against the sampling logprobs of the same weights.

Both ways in share it. `AutobucketGRPOTrainer` calls these functions from its overrides; a stock
`GRPOTrainer` given `make_rollout_func(RolloutConfig(kernels="invariant"))` gets them installed on the
instance by `score_on_invariant_kernels(trainer)` at its first generation batch. TRL's own scoring
forward (`fused_lm_head=True`) is replaced, not wrapped in the scope: its chunked LM head
(trl/kernels/chunked_logprob.py) reduces the vocabulary in tiles with an online fp32 logsumexp, another
function of the logits than the rollout's logprobs in bf16 (`trainer_logprobs`: log_softmax in the
logits' dtype), and another rounding order in fp32 once the vocabulary spans more than one tile.

Which weights the metric compares: with `num_iterations > 1` (or more steps per generation than
gradient accumulation steps) TRL trains on a generation batch again after an optimizer step, and there
the loss's logprobs differ from the sampling ones by the policy's own change, not by any kernel. So
`mismatch/k3` and `mismatch/max_abs_logp_diff` are logged only for micro-batches whose loss runs on the
weights that sampled them (no optimizer step since their generation batch: the first iteration)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from autobucket.engine.trainer_logprobs import mismatch_metrics


def invariant_per_token_logps(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, temperature: float,
    batch_size: int | None, compute_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] prompt+completion ids and mask -> per-token logprobs [B, logits_to_keep] (and entropies) of
    the last `logits_to_keep` tokens, from the model's own forward on the invariant kernels."""
    from trl.trainer.utils import entropy_from_logits

    from autobucket import invariant, trainer_logprobs
    from autobucket.engine.batching.prefill import positions_from_mask

    batch_size = batch_size or input_ids.shape[0]
    logps, entropies = [], []
    for start in range(0, input_ids.shape[0], batch_size):
        ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
        with invariant(model):
            logits = model(
                input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),  # over real tokens
                logits_to_keep=logits_to_keep + 1,
                use_cache=False,
            ).logits[:, :-1]  # [b, logits_to_keep, vocab]: the logits each completion token was sampled from
        logps.append(trainer_logprobs(logits, ids[:, -logits_to_keep:], temperature))
        if compute_entropy:  # with its graph, as TRL's own: the entropy bonus (entropy_coef) backpropagates it
            entropies.append(entropy_from_logits(logits / temperature))
    return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None)


def needs_trl_forward(compute_aux_loss: bool, multimodal: dict[str, Any]) -> bool:
    """Calls the invariant forward does not cover: a MoE load-balancing loss, image inputs."""
    return compute_aux_loss or any(value is not None for value in multimodal.values())


def _mode(trainer: Any) -> str:
    return "train" if trainer.model.training else "eval"


def mark_sampling_weights(trainer: Any) -> None:
    """Record, per mode, the optimizer step whose weights sample the generation batch now generating."""
    steps = getattr(trainer, "_autobucket_sampling_step", None) or {}
    trainer._autobucket_sampling_step = {**steps, _mode(trainer): trainer.state.global_step}


def log_mismatch(trainer: Any, inputs: dict[str, Any], trainer_logps: torch.Tensor | None) -> None:
    """Append the mismatch metrics of one micro-batch's loss logprobs ([B, T], detached) against its
    sampling logprobs to TRL's metrics, when both exist and the loss ran on the sampling weights."""
    sampling_logps = inputs.get("sampling_per_token_logps")
    if trainer_logps is None or sampling_logps is None:
        return
    mode = _mode(trainer)
    sampled_at = (getattr(trainer, "_autobucket_sampling_step", None) or {}).get(mode)
    if sampled_at != trainer.state.global_step:
        return  # a later iteration of the batch: the difference is policy drift, not mismatch
    mask = inputs["completion_mask"]
    if inputs.get("tool_mask") is not None:  # tool-result tokens were not sampled (logprob 0.0)
        mask = mask * inputs["tool_mask"]
    for name, value in mismatch_metrics(trainer_logps, sampling_logps, mask).items():
        trainer._metrics[mode][name].append(value)


def refresh_packs_once_per_step(trainer: Any, invariant_kernels: bool) -> None:
    """Once per optimizer step, mark the rollout's packed weights and (invariant kernels) the trainer
    scope's packs of the policy and reference model stale, and empty the prefix cache: TRL's ref-model
    sync writes weights through `.data`, which no version counter sees (optimizer steps, fused ones
    included, the engine sees itself)."""
    step = trainer.state.global_step
    if getattr(trainer, "_autobucket_weights_step", None) == step:
        return
    trainer._autobucket_weights_step = step
    cached = getattr(trainer, "_autobucket_rollout", None)
    if cached is not None:
        cached[2].refresh_weights()
    if invariant_kernels:
        from autobucket.engine.intercept.trainer import packs_for
        from autobucket.engine.model_access.hf_compat import unwrap_model

        for model in (trainer.model, getattr(trainer, "ref_model", None)):
            if model is not None:
                packs_for(unwrap_model(model)).refresh()


def score_on_invariant_kernels(trainer: Any) -> None:
    """Make a stock `GRPOTrainer`'s scoring bitwise the invariant rollout's, on this instance only (once):
    its per-token logprob forward (loss, old policy, reference model) becomes `invariant_per_token_logps`,
    its training step runs inside `autobucket.invariant(model)` (gradient checkpointing recomputes the
    forward during backward), and its loss logs the mismatch metrics. Calls the invariant forward does
    not cover (`needs_trl_forward`) run TRL's own."""
    if getattr(trainer, "_autobucket_scores_invariantly", False):
        return
    trainer_cls = type(trainer)

    def per_token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                        compute_aux_loss=False, **multimodal):
        refresh_packs_once_per_step(trainer, invariant_kernels=True)
        if needs_trl_forward(compute_aux_loss, multimodal):
            return trainer_cls._get_per_token_logps_and_entropies(
                trainer, model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal,
            )
        with _unchecked_outside_scoped_step(trainer):
            logps, entropies = invariant_per_token_logps(
                model, input_ids, attention_mask, logits_to_keep, trainer.temperature, batch_size, compute_entropy
            )
        if torch.is_grad_enabled():
            trainer._autobucket_last_logps = logps.detach()  # the loss's logprobs, compared in compute_loss
        return logps, entropies, None

    def training_step(model, inputs, num_items_in_batch=None):
        from autobucket import invariant

        refresh_packs_once_per_step(trainer, invariant_kernels=True)
        trainer._autobucket_step_scoped = True
        try:
            with invariant(trainer.model):
                return trainer_cls.training_step(trainer, model, inputs, num_items_in_batch)
        finally:
            trainer._autobucket_step_scoped = False

    def compute_loss(model, inputs):
        trainer._autobucket_last_logps = None
        loss = trainer_cls._compute_loss(trainer, model, inputs)
        log_mismatch(trainer, inputs, trainer._autobucket_last_logps)
        return loss

    trainer._autobucket_step_scoped = False
    trainer._get_per_token_logps_and_entropies = per_token_logps
    trainer.training_step = training_step
    trainer._compute_loss = compute_loss
    trainer._autobucket_scores_invariantly = True


def _unchecked_outside_scoped_step(trainer: Any) -> AbstractContextManager[Any]:
    """Gradient checkpointing off for a loss forward outside the scoped training step: the step whose
    generation batch installed the scoring was already running without the scope, and checkpointing
    would recompute that forward during its backward outside the scope, on other kernels (torch refuses
    the recomputed tensors). That one step then keeps its activations, as without checkpointing."""
    if not torch.is_grad_enabled() or trainer._autobucket_step_scoped:
        return nullcontext()
    from trl.models.utils import disable_gradient_checkpointing

    return disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)
