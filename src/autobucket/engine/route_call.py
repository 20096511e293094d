"""`RouteCall`: everything one `generate` call's route needs, built once by `Rollout` and read by the
routes and the admission policies (which never reach back into the `Rollout`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autobucket.config import RolloutConfig
from autobucket.costs.coefficients import CostCoefficients, ModelGeometry
from autobucket.costs.decode_figures import CompileFigures
from autobucket.engine.batching.prefix_cache import PrefixCache
from autobucket.engine.finished import StopStrings
from autobucket.engine.generation_setup import ResolvedSampling
from autobucket.engine.model_access.hf_compat import ForwardSpec, sliding_window_limit
from autobucket.planning.compile_choice import CompileDecision
from autobucket.profile import PhaseTimer, Profile


@dataclass(frozen=True)
class RouteCall:
    """Everything one generate call's route needs."""

    model: torch.nn.Module
    spec: ForwardSpec
    geometry: ModelGeometry
    costs: CostCoefficients
    config: RolloutConfig
    prompts: list[list[int]]
    sampling: ResolvedSampling  # for these prompts: budgets and stream keys filled (`for_prompts`)
    profile: Profile
    timer: PhaseTimer
    vocab_size: int
    max_positions: int | None
    compile_decision: CompileDecision | None = None  # decided once per call (`with_compile_decision`)
    prefix_cache: PrefixCache | None = None  # the Rollout's prefix cache, at this call's weights version
    stops: StopStrings | None = None  # the call's stop strings, matched with the Rollout's tokenizer
    compile_figures: CompileFigures | None = None  # decode figures measured on the device (None: prior only)

    @property
    def budgets(self) -> tuple[int, ...]:
        """Per prompt: its new-token budget (checked against the prompts by `Rollout.generate`)."""
        return self.sampling.budgets

    @property
    def most_new_tokens(self) -> int:
        """The largest budget: it bounds the call's decode steps and every row's cache columns."""
        return self.sampling.most_new_tokens

    @property
    def outgrown_window(self) -> str | None:
        """What the model's sliding attention window asks of this call when a sequence outgrows it (None: it
        fits, or there is no window): attention narrowed to the window on the continuous-batching routes."""
        window = sliding_window_limit(self.model.config)
        if window is None or not self.prompts:
            return None
        needed = max(len(prompt) + budget for prompt, budget in zip(self.prompts, self.budgets, strict=True))
        if needed <= window:
            return None
        return f"the model uses a sliding attention window of {window} tokens and this call needs {needed}"
