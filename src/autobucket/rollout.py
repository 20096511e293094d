"""`Rollout`: the public entry point. One `generate` call =

  resolve the generation config -> validate prompts -> pick the route -> run it -> results in input
  order, with a profile.

Routes are plain functions with one signature, chosen from `_ROUTES`. The CB routes differ only in
how an admission is split into prefill groups; `ContinuousBatcher` does the rest."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autobucket.config import RolloutConfig, SamplingConfig, sampling_or_default
from autobucket.continuous import CacheShape, ContinuousBatcher, Finished, GroupPrompts, Selection
from autobucket.costs import CostCoefficients, ModelGeometry
from autobucket.generation_setup import ResolvedGeneration, resolve_generation
from autobucket.hf_compat import (
    ForwardSpec,
    attention_implementation,
    forward_spec,
    sliding_window_limit,
    unwrap_model,
)
from autobucket.ordinary import run_ordinary
from autobucket.profile import PeakMemory, PhaseTimer, Profile
from autobucket.prompts import check_context, normalize_prompts, unpad_left_padded
from autobucket.result import RolloutResult
from autobucket.sampling import SamplerSettings, request_seeds


@dataclass
class _Call:
    """Everything one generate call's route needs."""

    rollout: Rollout
    prompts: list[list[int]]
    generation: ResolvedGeneration
    sampling: SamplingConfig
    selection: Selection
    profile: Profile
    timer: PhaseTimer

    @property
    def config(self) -> RolloutConfig:
        return self.rollout.config


class Rollout:
    """Batched, token-exact generation on a Hugging Face causal LM.

    >>> rollout = Rollout(model, tokenizer, RolloutConfig(route="auto"))
    >>> result = rollout.generate(prompts, SamplingConfig(max_new_tokens=16))
    """

    def __init__(self, model: Any, tokenizer: Any = None, config: RolloutConfig | None = None) -> None:
        self.model = unwrap_model(model)
        self.tokenizer = tokenizer
        self.config = config if config is not None else RolloutConfig()
        if not isinstance(self.config, RolloutConfig):
            raise TypeError(f"config must be a RolloutConfig, got {type(self.config).__name__}")
        self.spec: ForwardSpec = forward_spec(self.model)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_positions = _max_positions(self.model.config)
        self.costs = _resolve_costs(self.config, self.model)
        self.geometry = ModelGeometry.from_config(self.model.config, next(self.model.parameters()).dtype)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self, prompts: Sequence[Any], sampling: SamplingConfig | None = None, **overrides: Any
    ) -> RolloutResult:
        """Generate for every prompt; `overrides` are GenerationConfig fields (validated)."""
        started = time.perf_counter()
        sampling = sampling_or_default(sampling)
        generation = resolve_generation(self.model, sampling, overrides, self.vocab_size)
        token_prompts = normalize_prompts(prompts, self.tokenizer, self.vocab_size)
        check_context(token_prompts, sampling.max_new_tokens, self.max_positions)
        profile = Profile(route=self.config.route)
        timer = PhaseTimer(profile, self.device, synchronize=self.config.profile)
        if not token_prompts:
            return RolloutResult([], [], self.config.route, profile, [] if sampling.logprobs else None)
        selection = Selection(
            _sampler_settings(sampling, len(token_prompts)), generation.repetition_penalty, sampling.logprobs
        )
        call = _Call(self, token_prompts, generation, sampling, selection, profile, timer)
        with PeakMemory(self.device) as memory:
            finished = _ROUTES[self.config.route](call)
        return _result(call, finished, memory, started)

    def generate_padded(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        sampling: SamplingConfig | None = None,
        **overrides: Any,
    ) -> RolloutResult:
        """The RL-trainer layout: left-padded `[batch, width]` ids and mask."""
        return self.generate(unpad_left_padded(input_ids, attention_mask), sampling, **overrides)


def _resolve_costs(config: RolloutConfig, model: torch.nn.Module) -> CostCoefficients:
    """Coefficients for the auto route: given, a calibration file validated against the model, or the
    reference defaults."""
    costs = config.costs
    if costs is None:
        return CostCoefficients()
    if isinstance(costs, CostCoefficients):
        return costs
    from autobucket.calibration_file import load_calibration

    return load_calibration(costs, model=model, strict=config.costs_strict)


def _max_positions(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _sampler_settings(sampling: SamplingConfig, prompt_count: int) -> SamplerSettings:
    seeds = request_seeds(sampling.seed, prompt_count)
    return SamplerSettings(sampling.temperature, sampling.top_k, sampling.top_p, seeds)


def _nest(values: list, samples_per_prompt: int) -> list:
    """Per-item values -> per prompt (n == 1) or per prompt a list of n (n > 1)."""
    if samples_per_prompt == 1:
        return values
    return [values[start : start + samples_per_prompt] for start in range(0, len(values), samples_per_prompt)]


def _result(
    call: _Call, finished: dict[tuple[int, int], Finished], memory: PeakMemory, started: float
) -> RolloutResult:
    profile, n = call.profile, call.sampling.n
    ordered = [finished[(p, s)] for p in range(len(call.prompts)) for s in range(n)]
    tokens = [item.tokens for item in ordered]
    profile.output_tokens = sum(len(t) for t in tokens)
    profile.peak_memory_bytes = memory.peak_bytes()
    if call.timer.device.type == "cuda":
        torch.cuda.synchronize(call.timer.device)
    profile.total_ms = (time.perf_counter() - started) * 1e3
    profile.tokens_per_s = profile.output_tokens / max(profile.total_ms / 1e3, 1e-9)
    logprobs = _nest([item.logprobs for item in ordered], n) if call.sampling.logprobs else None
    return RolloutResult(
        _nest(tokens, n), _nest([item.reason for item in ordered], n), profile.route, profile, logprobs
    )


# ------------------------------------------------------------------ routes
def _route_ordinary(call: _Call) -> dict[tuple[int, int], Finished]:
    return run_ordinary(
        call.rollout.model, call.prompts, call.generation, call.selection, call.sampling.n,
        call.sampling.continuous_batch_size, call.profile, call.timer,
    )


def _route_equal_width(call: _Call) -> dict[tuple[int, int], Finished]:
    return _run_continuous(call, lambda admitted: _equal_width_groups(call, admitted))


def _route_aligned(call: _Call) -> dict[tuple[int, int], Finished]:
    return _run_continuous(call, lambda admitted: [[index] for index in admitted])


def _route_auto(call: _Call) -> dict[tuple[int, int], Finished]:
    from autobucket.auto import run_auto

    return run_auto(call)


_ROUTES = {
    "ordinary": _route_ordinary,
    "equal_width": _route_equal_width,
    "aligned": _route_aligned,
    "auto": _route_auto,
}


def _equal_width_groups(call: _Call, admitted: Sequence[int]) -> list[list[int]]:
    """One padded group per admission, split in input order only where it would pass the token limit."""
    limit = call.config.prefill_max_tokens
    groups: list[list[int]] = [[]]
    for index in admitted:
        width = max([len(call.prompts[i]) for i in groups[-1]] + [len(call.prompts[index])])
        if groups[-1] and limit is not None and width * (len(groups[-1]) + 1) > limit:
            groups.append([])
        groups[-1].append(index)
    return groups


def _run_continuous(call: _Call, group_prompts: GroupPrompts) -> dict[tuple[int, int], Finished]:
    model = call.rollout.model
    attention_implementation(model)
    _check_prefill_limit(call)
    _check_sliding_window(call)
    shape = _cache_shape(call)
    call.profile.capacity = shape.columns
    batcher = ContinuousBatcher(
        model, call.rollout.spec, call.generation, call.selection, shape, call.rollout.vocab_size,
        call.config.trim_cache, call.profile, call.timer,
    )
    finished = batcher.run(call.prompts, call.sampling.n, group_prompts)
    if batcher.store is not None:
        call.profile.kv_cache_bytes = batcher.store.nbytes
        call.profile.trims = batcher.store.trims
        call.profile.trimmed_columns = batcher.store.trimmed_columns
        call.profile.moved_bytes = batcher.store.moved_bytes
    return finished


def _cache_shape(call: _Call) -> CacheShape:
    rows = min(call.sampling.continuous_batch_size, len(call.prompts) * call.sampling.n)
    longest = max(len(p) for p in call.prompts)
    budget = call.sampling.max_new_tokens
    columns = call.config.cache_capacity
    if columns is None:
        # Enough for any schedule (see StaticKVCache: front - first live column <= longest + budget - 1
        # after trimming), plus one budget of headroom when refills will come, so trims stay rare.
        columns = longest + budget + (budget if len(call.prompts) * call.sampling.n > rows else 0)
    elif columns < longest + budget - 1:
        # A row holds its prompt plus budget - 1 fed-back tokens; trimming keeps every schedule within
        # longest + budget - 1 columns (see StaticKVCache), so this is the exact minimum.
        index = max(range(len(call.prompts)), key=lambda i: len(call.prompts[i]))
        raise ValueError(
            f"cache_capacity={columns} is too small: prompt {index} has {longest} tokens and max_new_tokens="
            f"{budget}, which needs {longest + budget - 1} columns; raise cache_capacity to at least "
            f"{longest + budget - 1} (or leave it None to size it per call)"
        )
    return CacheShape(rows=rows, columns=columns)


def _check_prefill_limit(call: _Call) -> None:
    limit = call.config.prefill_max_tokens
    if limit is None:
        return
    for index, prompt in enumerate(call.prompts):
        if len(prompt) > limit:
            raise ValueError(
                f"prompt {index} has {len(prompt)} tokens, more than prefill_max_tokens={limit} allows in one "
                "prefill forward (there is no chunked prefill yet): raise prefill_max_tokens or set it to None"
            )


def _check_sliding_window(call: _Call) -> None:
    window = sliding_window_limit(call.rollout.model.config)
    needed = max(len(p) for p in call.prompts) + call.sampling.max_new_tokens
    if window is not None and needed > window:
        raise ValueError(
            f"the model uses a sliding attention window of {window} tokens and this call needs {needed}: the "
            "continuous-batching routes do not implement sliding windows; use route='ordinary'"
        )
