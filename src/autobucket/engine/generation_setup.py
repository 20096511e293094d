"""Resolve what one `generate` call means before any route runs.

The effective generation config is the model's `generation_config` plus the caller's overrides
plus `SamplingConfig`; every route reads the same resolved values, so a route can never change the
tokens. Options the engine cannot honour are rejected *after* resolution, so an unsupported
setting hidden in the model's own generation config is caught too.

Sampling has one owner, `SamplingConfig`: its options are refused as overrides, and the model's own
sampling values (do_sample, temperature, top_k, top_p, min_p, typical_p, the cutoffs, top_h,
repetition_penalty) are inert — the resolved config has `do_sample=False` (HF never warps or samples;
`autobucket.engine.selection` does) and the penalty is SamplingConfig's."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from autobucket.config import SamplingConfig, checked_stop_strings
from autobucket.engine.sampling.row_processors import PROCESSOR_KEYWORDS, row_processors
from autobucket.engine.sampling.streams import request_seeds
from autobucket.engine.selection import SamplerSettings, Selection

# Keys a caller must set through SamplingConfig, not as generate overrides (one source of truth).
_SAMPLING_KEYS = (
    "max_new_tokens", "repetition_penalty", "eos_token_id", "temperature", "top_k", "top_p", "min_p", "typical_p",
    "epsilon_cutoff", "eta_cutoff", "stop_strings", "min_new_tokens",
)  # fmt: skip
# HF sampling warpers autobucket's sampler does not implement: refused as overrides (a model's own value
# is inert like every other sampling value of its generation_config).
_UNIMPLEMENTED_SAMPLING_KEYS = ("top_h",)


_MISSING = object()


class EngineGenerationConfig(GenerationConfig):
    """The resolved config HF `generate` runs with (the ordinary route): a copy of the model's
    generation_config with the call's values, where None means off (the fields the engine applies itself,
    min_new_tokens and stop_strings, and any option a caller unset with `option=None`).

    transformers 5.x fills every None field of the config `generate` is given, first from the model's own
    generation_config, then from its neutral defaults (`update(..., defaults_only=True)`; 4.57 did the
    first for default values unless `use_model_defaults=False`, which the ordinary route passes). The first
    would switch those fields back on with the model's values, so a fill is taken only where it offers the
    neutral default; every other update is GenerationConfig's."""

    def update(self, **kwargs: Any) -> dict[str, Any]:
        if kwargs.get("defaults_only"):
            neutral = getattr(GenerationConfig, "_get_default_generation_params", dict)()
            kwargs = {
                key: value for key, value in kwargs.items()
                if key in ("defaults_only", "allow_custom_entries") or neutral.get(key, _MISSING) == value
            }
        return super().update(**kwargs)


def _is_set(value: Any) -> bool:
    return value not in (None, 0, 0.0, False, [], (), {})


# option -> predicate on the resolved value that means "active, and we cannot honour it" (the options HF
# applies through per-sequence logits processors are applied by `sampling/row_processors.py`)
_UNSUPPORTED: dict[str, Any] = {
    "num_beams": lambda v: v is not None and v > 1,
    "num_beam_groups": lambda v: v is not None and v > 1,
    "num_return_sequences": lambda v: v is not None and v > 1,
    "penalty_alpha": _is_set,
    "diversity_penalty": _is_set,
    "encoder_no_repeat_ngram_size": _is_set,
    "encoder_repetition_penalty": lambda v: v is not None and v != 1.0,
    "force_words_ids": _is_set,
    "constraints": _is_set,
    "forced_bos_token_id": lambda v: v is not None,
    "forced_eos_token_id": lambda v: v is not None,
    "exponential_decay_length_penalty": _is_set,
    "guidance_scale": lambda v: v is not None and v != 1.0,
    "watermarking_config": _is_set,
    "prompt_lookup_num_tokens": _is_set,
    "token_healing": _is_set,  # rewrites the prompt's last tokens before generating
    "dola_layers": _is_set,
    "output_scores": _is_set,
    "output_logits": _is_set,
    "output_attentions": _is_set,
    "output_hidden_states": _is_set,
    "return_dict_in_generate": _is_set,
    "max_time": _is_set,
}


@dataclass(frozen=True)
class ResolvedSampling:
    """One call's sampling settings, resolved once (the caller's `SamplingConfig`, the model's
    generation_config and the call's overrides merged): the one record every route reads. The repetition
    penalty, the EOS ids and `min_new_tokens` live in `selection` only."""

    selection: Selection  # how a step's logits become tokens, and the EOS ids a request ends at
    n: int  # samples per prompt
    continuous_batch_size: int  # most sequences decoded at once
    budgets: tuple[int, ...]  # per prompt: its new-token budget (empty until `for_prompts`)
    per_prompt_budgets: bool  # the caller gave one budget per prompt, not one for all
    pad_token_id: int  # structural padding only; a generated token equal to it is kept
    stop_strings: tuple[str, ...]  # empty: none (HF's matching: `autobucket.engine.finished.StopStrings`)
    generation_config: Any = field(compare=False)  # the resolved transformers GenerationConfig (the ordinary route)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.selection.eos_token_ids

    @property
    def most_new_tokens(self) -> int:
        """The largest budget: it bounds the call's decode steps and every row's cache columns."""
        return max(self.budgets, default=1)

    def for_prompts(self, sampling: SamplingConfig, prompt_count: int) -> ResolvedSampling:
        """These settings for a call of `prompt_count` prompts: each prompt's budget and random stream key
        (`sampling`: the config these were resolved from)."""
        sampler = dataclasses.replace(self.selection.sampler, request_seeds=request_seeds(sampling.seed, prompt_count))
        selection = dataclasses.replace(self.selection, sampler=sampler)
        return dataclasses.replace(self, selection=selection, budgets=sampling.request_budgets(prompt_count))


def resolve_generation(
    model: torch.nn.Module, sampling: SamplingConfig, overrides: dict[str, Any], vocab_size: int
) -> ResolvedSampling:
    """Merge model defaults, caller overrides and `sampling`; reject what no route can honour. `overrides`
    may hold generate()'s processor keywords (`logits_processor`, `prefix_allowed_tokens_fn`). The result
    has no per-prompt budgets or stream keys yet (`ResolvedSampling.for_prompts` adds them)."""
    processor_keywords = {key: overrides[key] for key in PROCESSOR_KEYWORDS if key in overrides}
    overrides = {key: value for key, value in overrides.items() if key not in PROCESSOR_KEYWORDS}
    _reject_sampling_overrides(overrides)
    config = copy.deepcopy(model.generation_config)
    config.__class__ = EngineGenerationConfig  # the same fields and values; only its fills differ
    unknown = config.update(**overrides)
    if unknown:
        raise ValueError(
            f"unknown generate option(s) {sorted(unknown)}: they are not GenerationConfig fields; remove them"
        )
    config.do_sample = False  # autobucket selects tokens itself (autobucket.engine.selection); HF never samples
    config.max_new_tokens = sampling.most_new_tokens  # the ordinary route sets each batch's own largest
    config.repetition_penalty = sampling.repetition_penalty
    # SamplingConfig's value, else the model's (as HF generate would apply it); the engine's Selection
    # applies it on every route, so HF's own processor is off (it would mask the raw logits trainer-mode
    # logprobs are read from).
    min_new_tokens = sampling.min_new_tokens if sampling.min_new_tokens is not None else (config.min_new_tokens or 0)
    config.min_new_tokens = None
    _reject_unsupported(config)
    eos = eos_token_ids(sampling.eos_token_id if sampling.eos_token_id is not None else config.eos_token_id)
    for token in eos:
        if token >= vocab_size:
            raise ValueError(f"eos_token_id {token} is outside the vocabulary (size {vocab_size})")
    config.eos_token_id = list(eos)  # [] (not None): HF would fill None from the model's config
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    config.pad_token_id = pad
    stops = _stop_strings(sampling.stop_strings if sampling.stop_strings is not None else config.stop_strings)
    config.stop_strings = None  # the ordinary route checks them itself, over each prompt's own ids
    processors = row_processors(
        config, processor_keywords.get("logits_processor"), processor_keywords.get("prefix_allowed_tokens_fn"),
        eos, vocab_size, next(model.parameters()).device,
    )
    selection = Selection(
        _sampler_settings(sampling), sampling.repetition_penalty, sampling.logprobs, sampling.logprobs_mode,
        next(model.parameters()).dtype, eos_token_ids=eos, min_new_tokens=min_new_tokens, row_processors=processors,
    )
    return ResolvedSampling(
        selection, sampling.n, sampling.continuous_batch_size, (), isinstance(sampling.max_new_tokens, list),
        pad, stops, config,
    )


def _sampler_settings(sampling: SamplingConfig) -> SamplerSettings:
    """The sampler of `sampling`, without stream keys (`ResolvedSampling.for_prompts` adds each prompt's)."""
    return SamplerSettings(
        sampling.temperature, sampling.top_k, sampling.top_p, (), min_p=sampling.min_p,
        typical_p=sampling.typical_p, epsilon_cutoff=sampling.epsilon_cutoff, eta_cutoff=sampling.eta_cutoff,
    )


def _stop_strings(value: Any) -> tuple[str, ...]:
    """The resolved stop strings as a tuple (HF accepts one string or a list; a model's own value is
    checked like a caller's)."""
    checked = checked_stop_strings("stop_strings", value)
    if checked is None:
        return ()
    return (checked,) if isinstance(checked, str) else tuple(dict.fromkeys(checked))


def _reject_sampling_overrides(overrides: dict[str, Any]) -> None:
    if overrides.get("do_sample"):
        raise ValueError(
            "do_sample=True is not an override here: sample with SamplingConfig(temperature>0, top_k, top_p, "
            "min_p, typical_p, epsilon_cutoff, eta_cutoff, seed)"
        )
    if "max_length" in overrides:  # HF lets max_new_tokens, always set here, win: it would be ignored
        raise ValueError(
            f"generate option max_length={overrides['max_length']!r} is not an override here: the budget is "
            "SamplingConfig(max_new_tokens=...), the new tokens per request"
        )
    for key in _SAMPLING_KEYS:
        if key in overrides:
            raise ValueError(
                f"generate option {key!r} must be set in SamplingConfig, not as an override: pass "
                f"sampling=SamplingConfig({key}={overrides[key]!r}) instead"
            )
    for key in _UNIMPLEMENTED_SAMPLING_KEYS:
        if key in overrides:
            raise ValueError(
                f"generate option {key}={overrides[key]!r} is not supported by autobucket's sampler: remove it "
                "(SamplingConfig offers temperature, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff)"
            )


def first_unsupported_option(config: Any) -> tuple[str, Any] | None:
    """(option, value) of the first option of a transformers GenerationConfig that is active and that no
    route can honour, or None (a trainer adapter checks its trainer's config with this too)."""
    for option, is_active in _UNSUPPORTED.items():
        value = getattr(config, option, None)
        if is_active(value):
            return option, value
    return None


def _reject_unsupported(config: Any) -> None:
    found = first_unsupported_option(config)
    if found is not None:
        option, value = found
        raise ValueError(
            f"generation option {option}={value!r} (from the model's generation_config or your overrides) "
            f"is not supported by autobucket; unset it (e.g. {option}=None) to generate"
        )


def eos_token_ids(value: Any) -> tuple[int, ...]:
    """EOS ids as a de-duplicated tuple, from an int, a list, a tensor or None (none)."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    ids = [value] if isinstance(value, int) else list(value)
    return tuple(dict.fromkeys(int(i) for i in ids))
