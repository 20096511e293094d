"""The body of one `RayRollout` actor: a `Rollout` built from a model factory inside the worker, and the
forward pre-hook (on the input embeddings, which every forward runs) that stops a shard Ray has cancelled."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients, ModelGeometry
from autobucket.prompts import normalize_prompts
from autobucket.result import RolloutResult
from autobucket.threads import set_torch_threads

ModelFactory = Callable[[], Any] | str


@dataclass(frozen=True)
class WorkerInfo:
    """What the driver needs from a worker's model to validate and shard prompts."""

    geometry: ModelGeometry
    costs: CostCoefficients
    vocab_size: int
    max_positions: int | None


class Worker:
    """The actor body. The model is loaded by `load`, not the constructor, so a failing factory raises
    a normal task error (original type visible) and leaves a live actor that a new factory can fix."""

    def __init__(self, config: RolloutConfig, torch_threads: int | None) -> None:
        set_torch_threads(torch_threads)
        self.config = config
        self.rollout: Any = None

    def load(self, factory: ModelFactory) -> None:
        from autobucket.engine.rollout import Rollout

        self.rollout = None
        model, tokenizer = build_model(factory)
        self.rollout = Rollout(model, tokenizer, self.config)
        # On the input embeddings, which every forward runs (the direct decode step's too), not on the
        # model, whose forward the direct step bypasses: a hook there would turn that step off.
        self.rollout.model.get_input_embeddings().register_forward_pre_hook(stop_if_cancelled)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._rollout().model.load_state_dict(state_dict)

    def describe(self) -> WorkerInfo:
        rollout = self._rollout()
        return WorkerInfo(rollout.geometry, rollout.costs, rollout.vocab_size, rollout.max_positions)

    def normalize(self, prompts: Sequence[Any]) -> list[list[int]]:
        rollout = self._rollout()
        return normalize_prompts(prompts, rollout.tokenizer, rollout.vocab_size)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, overrides: dict, call_indices: Sequence[int]
    ) -> RolloutResult:
        """The shard's call; `call_indices[i]`: shard prompt i's index in the caller's whole call, which a
        `prefix_allowed_tokens_fn` is given (as one process's call would give it), not its shard index."""
        allowed = overrides.get("prefix_allowed_tokens_fn")
        if callable(allowed):
            overrides = {**overrides, "prefix_allowed_tokens_fn": CallIndexed(allowed, list(call_indices))}
        return self._rollout().generate(prompts, sampling, **overrides)

    def _rollout(self) -> Any:
        if self.rollout is None:
            raise RuntimeError("this worker has no model: its factory failed; pass a working one to update_weights")
        return self.rollout


@dataclass(frozen=True)
class CallIndexed:
    """A caller's `prefix_allowed_tokens_fn(batch_id, ids)` inside a shard: batch ids mapped back to the
    whole call's prompt indices."""

    function: Callable[[int, torch.Tensor], Any]
    call_indices: list[int]

    def __call__(self, batch_id: int, ids: torch.Tensor) -> Any:
        return self.function(self.call_indices[batch_id], ids)


def build_model(factory: ModelFactory) -> tuple[Any, Any]:
    """(model, tokenizer) from a factory, or from a model name as `autobucket.load_model` takes it
    (tiny name, smollm2, folder, HF id, config.json)."""
    if isinstance(factory, str):
        from autobucket.models import load_model

        return load_model(factory)
    built = factory()
    return built if isinstance(built, tuple) else (built, None)


class ShardCancelled(RuntimeError):
    """Raised inside a worker whose shard was cancelled because another shard failed."""


def stop_if_cancelled(module: torch.nn.Module, args: Any) -> None:
    import ray

    context = ray.get_runtime_context()
    # Ray flags a running sync-actor task on ray.cancel since ray-project/ray#58914 (late 2025);
    # on older Ray `is_canceled` is missing, only queued shards are cancelled, running ones finish.
    if getattr(context, "is_canceled", None) is not None and context.is_canceled():
        raise ShardCancelled("shard cancelled: another worker failed")
