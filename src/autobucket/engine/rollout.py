"""`Rollout`: the public entry point. One `generate` call =

  resolve the generation config -> validate prompts -> run the configured route -> results in input
  order, with a profile.

Routes are plain functions with one signature, chosen from `routes.ROUTES`; each receives a
`RouteCall` holding everything it needs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from autobucket.coefficients.file import load_calibration
from autobucket.config import RolloutConfig, SamplingConfig, sampling_or_default
from autobucket.engine.finished import Finished
from autobucket.engine.generation_setup import resolve_generation
from autobucket.engine.hf_compat import ForwardSpec, forward_spec, unwrap_model, vocab_size
from autobucket.engine.routes import ROUTES, RouteCall
from autobucket.engine.selection import SamplerSettings, Selection, request_seeds
from autobucket.planning.costs import CostCoefficients, ModelGeometry
from autobucket.profile import PeakMemory, PhaseTimer, Profile
from autobucket.prompts import check_context, normalize_prompts, unpad_left_padded
from autobucket.result import RolloutResult
from autobucket.threads import warn_if_oversubscribed


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
        self.vocab_size = vocab_size(self.model)
        self.geometry = ModelGeometry.from_config(self.model.config, next(self.model.parameters()).dtype)
        self.max_positions = self.geometry.max_positions
        self.costs = _resolve_costs(self.config, self.model)
        warn_if_oversubscribed()  # a 5-20x slowdown on small CPU machines (autobucket.threads)

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
        call = RouteCall(
            self.model, self.spec, self.geometry, self.costs, self.config, token_prompts, generation,
            sampling, selection, profile, timer, self.vocab_size, self.max_positions,
        )  # fmt: skip
        with PeakMemory(self.device) as memory:
            finished = ROUTES[self.config.route](call)
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
    """Coefficients for the planner: given, a calibration file validated against the model, or the
    reference defaults."""
    costs = config.costs
    if costs is None:
        return CostCoefficients()
    if isinstance(costs, CostCoefficients):
        return costs
    return load_calibration(costs, model=model, strict=config.costs_strict)


def _sampler_settings(sampling: SamplingConfig, prompt_count: int) -> SamplerSettings:
    seeds = request_seeds(sampling.seed, prompt_count)
    return SamplerSettings(sampling.temperature, sampling.top_k, sampling.top_p, seeds)


def _nest(values: list, samples_per_prompt: int) -> list:
    """Per-item values -> per prompt (n == 1) or per prompt a list of n (n > 1)."""
    if samples_per_prompt == 1:
        return values
    return [values[start : start + samples_per_prompt] for start in range(0, len(values), samples_per_prompt)]


def _result(
    call: RouteCall, finished: dict[tuple[int, int], Finished], memory: PeakMemory, started: float
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
