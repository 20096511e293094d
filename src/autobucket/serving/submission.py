"""A submission checked and turned into a `Request` record, in the caller's thread: bad input raises there
(naming the field, the value and the fix) and never reaches the engine's loop."""

from __future__ import annotations

import operator
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autobucket.config import SamplingConfig
from autobucket.engine.finished import StopStrings
from autobucket.engine.generation_setup import resolve_generation
from autobucket.engine.sampling.streams import request_seeds
from autobucket.prompts import normalize_prompts
from autobucket.serving.request import Request


@dataclass(frozen=True)
class Limits:
    """What every request must fit: the engine's model, tokenizer and context length."""

    model: torch.nn.Module
    tokenizer: Any
    vocab_size: int
    max_model_len: int  # prompt + generated + max_new_tokens, at most


def build_request(
    limits: Limits,
    prompt: Any,
    sampling: SamplingConfig | None,
    request_id: str | None,
    sample: int,
    generated: Sequence[int],
    stop_matcher: Callable[[tuple[str, ...]], StopStrings],
    overrides: dict[str, Any],
) -> Request:
    """The request record for one submission (`stop_matcher`: the engine's matcher for a tuple of stop
    strings, kept across requests).
    `overrides`: GenerationConfig fields and generate()'s `logits_processor` / `prefix_allowed_tokens_fn`,
    as `Rollout.generate` takes them."""
    sampling = _checked_sampling(sampling)
    generation = resolve_generation(limits.model, sampling, overrides, limits.vocab_size)
    prompt_ids = normalize_prompts([prompt], limits.tokenizer, limits.vocab_size)[0]
    before = _checked_generated(generated, limits.vocab_size)
    _check_length(len(prompt_ids), len(before), sampling.max_new_tokens, limits.max_model_len)
    return Request(
        request_id=_checked_id(request_id),
        prompt_ids=prompt_ids,
        generated=before,
        sampling=sampling,
        generation=generation,
        stream_key=request_seeds(sampling.seed, 1)[0],
        sample=_checked_sample(sample),
        stops=_stop_matcher(generation.stop_strings, limits.tokenizer, stop_matcher),
    )


def _checked_sampling(sampling: SamplingConfig | None) -> SamplingConfig:
    if sampling is None:
        return SamplingConfig()
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if sampling.n != 1:
        raise ValueError(
            f"n={sampling.n}: a request is one sequence; submit each sample on its own with sample=0..n-1 "
            "(equal prompts share one prefill)"
        )
    if isinstance(sampling.max_new_tokens, list):
        raise ValueError(f"max_new_tokens={sampling.max_new_tokens!r}: a request has one budget; pass one int")
    return sampling


def _checked_generated(generated: Sequence[int], vocab_size: int) -> list[int]:
    if isinstance(generated, (str, bytes)) or not isinstance(generated, Sequence):
        raise TypeError(
            f"generated must be a list of token ids (the request's tokens so far), got {type(generated).__name__}"
        )
    ids = []
    for token in generated:
        try:
            value = None if isinstance(token, bool) else operator.index(token)
        except TypeError:
            value = None
        if value is None or not 0 <= value < vocab_size:
            raise ValueError(f"generated has token id {token!r}: token ids are integers in [0, {vocab_size})")
        ids.append(value)
    return ids


def _check_length(prompt: int, generated: int, budget: int, max_model_len: int) -> None:
    if prompt + generated + budget > max_model_len:
        raise ValueError(
            f"the prompt's {prompt} tokens + {generated} generated + max_new_tokens={budget} pass the engine's "
            f"max_model_len={max_model_len}: lower max_new_tokens to at most {max_model_len - prompt - generated}, "
            "or create the engine with a larger max_model_len"
        )


def _checked_id(request_id: str | None) -> str:
    if request_id is None:
        return uuid.uuid4().hex
    if not isinstance(request_id, str) or not request_id:
        raise TypeError(f"request_id must be a non-empty string or None (one is made), got {request_id!r}")
    return request_id


def _checked_sample(sample: int) -> int:
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 0:
        raise ValueError(
            f"sample={sample!r} is invalid: pass the sample's index among its prompt's samples, an int >= 0"
        )
    return sample


def _stop_matcher(
    strings: tuple[str, ...], tokenizer: Any, matcher: Callable[[tuple[str, ...]], StopStrings]
) -> StopStrings | None:
    if not strings:
        return None
    if tokenizer is None:
        raise ValueError(
            f"stop_strings={list(strings)!r} need the model's tokenizer to match text: create the engine with "
            "it, AsyncEngine(model, tokenizer), or pass stop_strings=[]"
        )
    return matcher(strings)
