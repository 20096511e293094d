"""The one generation function behind both TRL entry points (`trl.py`), and the checks before it.

`generate_completions(trainer, prompt_ids, ...)`: TRL's prompt ids (each prompt repeated
`num_generations` times in a row) -> completion ids through the first EOS and, when sampling, their
logprobs. Runs of identical prompts become one prompt with `SamplingConfig(n=run length)` (prefilled once,
its KV shared by its samples); a run's stream key derives from (trainer seed, global step, process index,
generation call, run index), so a training run is reproducible and the sampled tokens do not depend on the
route or the batch plan. Settings come from the trainer's `generation_config`; anything autobucket cannot
honour raises a ValueError naming the option. On a trainer sharded over ranks (ZeRO-3, FSDP2) the checks
and the generation run on the gathered weights, and a rank whose call fails raises on every rank
(`sharded_over_ranks`, docs/sharded-trainers.md)."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from trl.models import unwrap_model_for_generation

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.generation_setup import first_unsupported_option
from autobucket.engine.model_access.rank_failures import distributed_ready, failures_shared
from autobucket.engine.model_access.sharded_weights import gathered_weights, gathering_communicates
from autobucket.engine.sampling.row_processors import ROW_PROCESSOR_OPTIONS
from autobucket.integrations.generation_options import reject_unsupported_warpers, warper_settings
from autobucket.integrations.zero3_weights import start_of_forward_hook_off

_HF_DEFAULT_TOP_K = 50  # what transformers applies when a sampling config leaves top_k unset


# ------------------------------------------------------------------ validation
def check_trainer_supported(trainer: Any) -> None:
    """Reject trainer modes autobucket does not replace, and sampling options it cannot honour."""
    check_args_supported(trainer.args)
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3 and not trainer.args.ds3_gather_for_generation:
        raise ValueError(
            "ds3_gather_for_generation=False is not supported by the autobucket trainer under ZeRO stage 3: ranks "
            "would run different numbers of forwards over partitioned weights; set ds3_gather_for_generation=True"
        )
    sampling_from_generation_config(trainer.generation_config, trainer.eos_token_ids)


def check_args_supported(args: Any) -> None:
    """GRPOConfig modes in which generation would not run through autobucket."""
    if getattr(args, "use_vllm", False):
        raise ValueError(
            "use_vllm=True is not supported by the autobucket trainer: generation would run in vLLM, not "
            "autobucket; set use_vllm=False (or use the stock GRPOTrainer for vLLM)"
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        raise ValueError(
            "use_transformers_continuous_batching=True is not supported by the autobucket trainer: autobucket "
            "replaces that path; set use_transformers_continuous_batching=False"
        )


def reject_multimodal(images: Any, multimodal_fields: Any) -> None:
    if images is not None and any(image for image in images):
        raise ValueError(
            "prompts with images are not supported by autobucket (text-only causal LMs): use the stock "
            "GRPOTrainer for vision-language models"
        )
    if multimodal_fields:
        raise ValueError(
            f"multimodal processor fields {sorted(multimodal_fields)} are not supported by autobucket: use the "
            "stock GRPOTrainer for vision-language models"
        )


def sampling_from_generation_config(generation_config: Any, eos_token_ids: Sequence[int]) -> SamplingConfig:
    """TRL's GenerationConfig -> autobucket SamplingConfig (n and seed are set per call)."""
    reject_unsupported_warpers(
        generation_config,
        "generation option",
        "unset it ({option}={off!r}, via GRPOConfig or generation_kwargs) or use the stock GRPOTrainer",
    )
    # Options transformers would apply and autobucket cannot (num_beams, forced_eos_token_id, ...): refused,
    # never generated without.
    found = first_unsupported_option(generation_config)
    if found is not None:
        option, value = found
        raise ValueError(
            f"generation option {option}={value!r} (GRPOConfig.generation_kwargs) is not supported by autobucket: "
            "remove it from generation_kwargs, or use the stock GRPOTrainer"
        )
    if (generation_config.min_length or 0) > 0:
        raise ValueError(
            f"generation option min_length={generation_config.min_length!r} (GRPOConfig.generation_kwargs) is not "
            "supported by the autobucket trainer: the stock trainer's batched generate counts each prompt's left "
            "padding toward it, autobucket each sequence's own length, so completions would differ; use "
            "min_new_tokens (the completion's own minimum) instead"
        )
    _check_eos_agrees(generation_config, eos_token_ids)
    max_new_tokens = generation_config.max_new_tokens
    if max_new_tokens is None:
        raise ValueError("max_completion_length=None is not supported by autobucket: set a completion budget")
    penalty = generation_config.repetition_penalty
    return SamplingConfig(
        max_new_tokens=max_new_tokens,
        repetition_penalty=1.0 if penalty is None else float(penalty),
        eos_token_id=[int(token) for token in eos_token_ids],
        # generation_kwargs={"stop_strings": [...]}: matched with the trainer's tokenizer (`_rollout_for`)
        stop_strings=getattr(generation_config, "stop_strings", None) or [],
        # generation_kwargs' value, else (None) the model's own, as TRL's `generate` fills an unset field
        min_new_tokens=getattr(generation_config, "min_new_tokens", None),
        greedy_copies=True,  # TRL asks for each prompt num_generations times, greedy or not, as its own generate
        **_warping(generation_config),
    )


def processor_options(generation_config: Any) -> dict[str, Any]:
    """The trainer's generation options that logits processors apply (suppress_tokens, bad_words_ids,
    no_repeat_ngram_size, ...; min_length is refused above), as `Rollout.generate` overrides: autobucket
    applies them to each sequence as the stock trainer's `generate` does to its rows."""
    options = {option: getattr(generation_config, option, None) for option in ROW_PROCESSOR_OPTIONS if option != "min_length"}
    return {option: value for option, value in options.items() if value is not None}


def _check_eos_agrees(generation_config: Any, eos_token_ids: Sequence[int]) -> None:
    """TRL stops generation at its GenerationConfig's EOS ids but masks completions with `eos_token_ids`;
    they are the same list unless generation_kwargs overrides eos_token_id, and then the stock trainer's
    completions run on past their end as padding, which autobucket cannot reproduce: refused."""
    stop_ids = generation_config.eos_token_id
    if stop_ids is None:  # a config without EOS ids (not TRL's own): the trainer's apply
        return
    if sorted([stop_ids] if isinstance(stop_ids, int) else stop_ids) != sorted(eos_token_ids):
        raise ValueError(
            f"generation option eos_token_id={generation_config.eos_token_id!r} (GRPOConfig.generation_kwargs) "
            f"differs from the trainer's eos_token_ids {list(eos_token_ids)}, which TRL masks completions with: "
            "remove it from generation_kwargs and set the model's generation_config.eos_token_id instead"
        )


def _warping(generation_config: Any) -> dict[str, Any]:
    if not generation_config.do_sample:
        return {"temperature": 0.0}
    top_k, top_p = generation_config.top_k, generation_config.top_p
    return {
        "temperature": 1.0 if generation_config.temperature is None else float(generation_config.temperature),
        "top_k": _HF_DEFAULT_TOP_K if top_k is None else int(top_k),
        "top_p": 1.0 if top_p is None else float(top_p),
        **warper_settings(generation_config),  # GRPOConfig's min_p; typical_p and cutoffs via generation_kwargs
    }


def check_prompt_context(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, model: Any) -> None:
    """A prompt plus its completion budget must fit the model's context (TRL-worded error)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    for index, prompt in enumerate(prompt_ids):
        if limit is not None and len(prompt) + max_new_tokens > limit:
            raise ValueError(
                f"prompt {index} has {len(prompt)} tokens; with max_completion_length={max_new_tokens} it needs "
                f"{len(prompt) + max_new_tokens} positions but the model's context is {limit}: shorten the "
                "dataset's prompts or lower max_completion_length"
            )


# ------------------------------------------------------------------ generation
def prompt_runs(prompt_ids: Sequence[Sequence[int]], longest: int | None = None) -> list[tuple[list[int], int]]:
    """Consecutive identical prompts -> (prompt, run length), in order; runs are at most `longest` long
    (TRL's `num_generations`: 1 for tool-calling turns, whose conversations are each sampled once)."""
    runs: list[tuple[list[int], int]] = []
    for ids in prompt_ids:
        ids = list(ids)
        if runs and runs[-1][0] == ids and (longest is None or runs[-1][1] < longest):
            runs[-1] = (ids, runs[-1][1] + 1)
        else:
            runs.append((ids, 1))
    return runs


def generation_seed(trainer: Any) -> int:
    """One stream key per generation call: (trainer seed, global step, process, call number)."""
    calls = getattr(trainer, "_autobucket_generation_calls", 0)
    trainer._autobucket_generation_calls = calls + 1
    key = f"{trainer.args.seed}/{trainer.state.global_step}/{trainer.accelerator.process_index}/{calls}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def run_seeds(call_seed: int, run_count: int) -> list[int]:
    """Per-run stream keys: a run's samples do not depend on how runs are grouped into calls."""
    return [
        int.from_bytes(hashlib.blake2b(f"{call_seed}/{run}".encode(), digest_size=8).digest(), "little")
        for run in range(run_count)
    ]


def context_budgets(runs: list[tuple[list[int], int]], max_new_tokens: int, model: Any) -> list[int]:
    """Per run: the new tokens a tool-calling turn generates, `max_new_tokens` or what the model's context
    leaves. TRL keeps at most `max_completion_length - (conversation - prompt)` of a later turn, which the
    context leaves whenever the first turn fitted, so the cap drops only tokens TRL would cut."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None:
        return [max_new_tokens] * len(runs)
    budgets = []
    for index, (prompt, _) in enumerate(runs):
        if len(prompt) >= limit:
            raise ValueError(
                f"tool-calling turn: conversation {index} has {len(prompt)} tokens, the model's whole context "
                f"({limit}): lower max_completion_length or max_tool_calling_iterations"
            )
        budgets.append(min(max_new_tokens, limit - len(prompt)))
    return budgets


def generate_completions(
    trainer: Any, prompt_ids: Sequence[Sequence[int]], config: RolloutConfig, continuous_batch_size: int | None,
    num_generations: int | None = None, continued: bool = False, runner: Callable[..., Any] | None = None,
) -> tuple[list[list[int]], list[list[float]] | None]:
    """Completion ids (through the first EOS) and, when sampling, their logprobs, one per input row.

    num_generations: the longest run of identical prompts sampled as one prompt with n (None: any).
    continued: a tool-calling turn (conversations, not dataset prompts): each run generates what the
    model's context leaves, up to the budget, where a first turn raises.
    runner: (trainer, model, config) -> the function that generates the runs (`_generate_runs`' arguments
    after the rollout; None: `Rollout.generate`, `rollout_runner`; `trl_async.TrainerEngine.runner`)."""
    wrapped, call_seed = trainer.model_wrapped, generation_seed(trainer)
    # Nothing before the weights' gathering (a collective) can fail on one rank only: the checks run after
    # it, with the generation, and a rank that fails raises on every rank once each has generated on its
    # gathered weights (where no collective waits on it), before any rank goes on to the training step.
    with (
        unwrap_model_for_generation(  # ZeRO-3: every parameter gathered (ds3_gather_for_generation), hooks off
            wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model,
        start_of_forward_hook_off(wrapped),  # ZeRO-3: the one hook TRL leaves, a collective (zero3_weights)
        torch.no_grad(),
        trainer._dist.summon_full_params(wrapped, recurse=False),
        failures_shared(sharded_over_ranks(trainer)),
        # FSDP2: one gather for all of this rank's calls (one per distinct run length, which can differ
        # between ranks when a prompt group is split across them); the calls inside communicate nothing
        gathered_weights(wrapped),
    ):
        if len(prompt_ids) == 0:
            raise ValueError("the generation batch is empty: TRL passed no prompts; check the dataset and batch size")
        base = sampling_from_generation_config(trainer.generation_config, trainer.eos_token_ids)
        base = replace(base, logprobs=base.temperature > 0, continuous_batch_size=continuous_batch_size or len(prompt_ids))
        runs = prompt_runs(prompt_ids, num_generations)
        if continued:
            budgets = context_budgets(runs, base.max_new_tokens, model)
        else:
            check_prompt_context(prompt_ids, base.max_new_tokens, model)
            budgets = [base.max_new_tokens] * len(runs)
        generate_runs = (runner or rollout_runner)(trainer, model, config)
        samples, results = generate_runs(
            runs, run_seeds(call_seed, len(runs)), budgets, base, processor_options(trainer.generation_config)
        )
    trainer.autobucket_routes = [r.route for r in results]  # what ran last ("bucketed" / "ordinary" under auto)
    trainer.autobucket_profiles = [r.profile for r in results]
    completions = [tokens for tokens, _ in samples]
    return completions, ([logprobs for _, logprobs in samples] if base.logprobs else None)


def sharded_over_ranks(trainer: Any) -> bool:
    """Whether the trainer's weights are sharded over ranks (DeepSpeed ZeRO-3, or FSDP2 groups that are
    sharded now), in an initialised process group of more than one rank: then its generation gathers
    the weights, a collective every rank must join, and a rank leaving the call early would strand the
    others there or at the training step's next collective. Unsharded trainers (DDP) share nothing: TRL's
    tool-calling loop makes a per-rank number of generation calls, which matched collectives would hang."""
    if not distributed_ready():
        return False
    import torch.distributed as dist

    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    zero3 = plugin is not None and plugin.zero_stage == 3
    return dist.get_world_size() > 1 and (zero3 or gathering_communicates(trainer.model_wrapped))


def rollout_runner(trainer: Any, model: Any, config: RolloutConfig) -> Callable[..., Any]:
    """The default generator of runs: the trainer's `Rollout.generate`."""
    return functools.partial(_generate_runs, _rollout_for(trainer, model, config))


def _rollout_for(trainer: Any, model: Any, config: RolloutConfig) -> Rollout:
    """The trainer's Rollout, rebuilt only when the unwrapped model or the config changes (weights are
    read live, so a training step needs no rebuild; a costs file is loaded once)."""
    cached = getattr(trainer, "_autobucket_rollout", None)
    if cached is None or cached[0] is not model or cached[1] is not config:
        # the tokenizer only matches stop strings: prompts reach the Rollout as ids
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        cached = (model, config, Rollout(model, tokenizer, config))
        trainer._autobucket_rollout = cached
    return cached[2]


def _generate_runs(
    rollout: Rollout, runs: list[tuple[list[int], int]], seeds: list[int], budgets: list[int], base: SamplingConfig,
    options: dict[str, Any],
) -> tuple[list[tuple[list[int], list[float] | None]], list[Any]]:
    """One `generate` per distinct run length (normally one: every run is num_generations long), each run
    with its own token budget and the generation `options` (`processor_options`); returns (tokens, logprobs)
    per completion in the input's row order, and the results (route, profile) of the calls that ran."""
    per_run: dict[int, list[tuple[list[int], list[float] | None]]] = {}
    results = []
    for n in sorted({count for _, count in runs}):
        members = [r for r, (_, count) in enumerate(runs) if count == n]
        sampling = replace(base, n=n, max_new_tokens=[budgets[r] for r in members], seed=[seeds[r] for r in members])
        result = rollout.generate([runs[r][0] for r in members], sampling, **options)
        results.append(result)
        for position, r in enumerate(members):
            per_run[r] = _run_samples(result, position, n)
    return [sample for r in range(len(runs)) for sample in per_run[r]], results


def _run_samples(result: Any, position: int, n: int) -> list[tuple[list[int], list[float] | None]]:
    """The n samples of one prompt of a result (n == 1 results are not nested)."""
    tokens = result.tokens[position] if n > 1 else [result.tokens[position]]
    if result.logprobs is None:
        return [(list(t), None) for t in tokens]
    logprobs = result.logprobs[position] if n > 1 else [result.logprobs[position]]
    return [(list(t), list(lp)) for t, lp in zip(tokens, logprobs, strict=True)]
