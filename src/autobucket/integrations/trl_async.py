"""TRL's generation requests through an `AsyncEngine` on the trainer's own model
(`AutobucketGRPOTrainer(engine="async")`), instead of one `Rollout.generate` call per run length.

One engine per trainer (`TrainerEngine`), made at its first generation call on the unwrapped model and
parked (`pause()`) whenever the trainer is not generating: a generation call resumes it, submits every
completion as its own request and pauses it again once every result is in, so nothing of the engine
touches the model during the loss, the backward or the optimizer step, and each resume reads the weights
as the optimizer left them. It is closed at the end of `train()` (and when the trainer is collected).

Why the completions are the `Rollout.generate` path's: TRL's rows come as runs of identical prompts; the
synchronous path samples run r as `generate([prompt], n=len(run), seed=[key_r])`, and sample i of it is
here the request `submit(prompt, seed=[key_r], sample=i)`, whose random stream is keyed alike
(`serving/request.py`). Greedy tokens equal single-request HF `generate` on either path; with
`kernels="invariant"` sampled tokens and logprobs are bitwise the same on both.

Not available here: sharded models (FSDP, ZeRO-3: the engine's thread would run forwards outside the
gathering the trainer's thread holds) and reuse of a finished turn's K/V by the next tool-calling turn
(the engine has no prefix cache across requests: each turn prefills its whole conversation)."""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autobucket import RolloutConfig, SamplingConfig
from autobucket.profile import Profile
from autobucket.serving import AsyncEngine, RequestHandle

ENGINES = ("rollout", "async")
SMALLEST_MODEL_LEN = 64  # the engine's context is sized up in powers of two from here

RunSamples = list[tuple[list[int], list[float] | None]]


@dataclass(frozen=True)
class AsyncCall:
    """What one generation call on the engine reports as its route and profile (as a rollout result does)."""

    profile: Profile
    route: str = "async"


def checked_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(
            f"engine={engine!r} is invalid: pass 'rollout' (one Rollout.generate call per generation batch) or "
            "'async' (every completion a request on the trainer's AsyncEngine)"
        )
    return engine


class TrainerEngine:
    """The trainer's `AsyncEngine`, made on first use and resized (closed and made again) only when a call
    needs more rows or a longer context than it has. `runner` plugs it into `generate_completions`."""

    def __init__(self, continuous_batch_size: int | None) -> None:
        self.continuous_batch_size = continuous_batch_size
        self.engine: AsyncEngine | None = None
        self._made_for: tuple[Any, RolloutConfig] | None = None
        self._size = (0, 0)  # the engine's (max_batch, max_model_len)
        self._refreshed_at_step: int | None = None

    def attach(self, trainer: Any) -> None:
        """Close the engine when `trainer` is garbage collected (the finalizer does not keep it alive)."""
        weakref.finalize(trainer, self.close)

    def runner(self, trainer: Any, model: Any, config: RolloutConfig) -> Callable[..., tuple[RunSamples, list[AsyncCall]]]:
        """`generate_completions`' generator of runs on this engine (checked before anything runs)."""
        _refuse_sharded(trainer)
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)  # stop strings only
        return functools.partial(self._generate_runs, trainer, model, tokenizer, config)

    def close(self) -> None:
        """Abort what is in flight and stop the engine's thread (idempotent; a later call makes a new one)."""
        if self.engine is not None:
            self.engine.close()
        self.engine, self._made_for, self._size, self._refreshed_at_step = None, None, (0, 0), None

    def _generate_runs(
        self, trainer: Any, model: Any, tokenizer: Any, config: RolloutConfig, runs: list[tuple[list[int], int]],
        seeds: list[int], budgets: list[int], base: SamplingConfig, options: dict[str, Any],
    ) -> tuple[RunSamples, list[AsyncCall]]:
        """(tokens, logprobs) per completion in TRL's row order, sample i of run r as one request."""
        started = time.perf_counter()
        rows = sum(count for _, count in runs)
        longest = max(len(prompt) + budget for (prompt, _), budget in zip(runs, budgets, strict=True))
        engine = self._engine_for(model, tokenizer, config, rows, longest)
        self._refresh_once_per_step(engine, trainer.state.global_step)
        engine.resume()
        handles: list[RequestHandle] = []
        try:
            for (prompt, count), seed, budget in zip(runs, seeds, budgets, strict=True):
                sampling = replace(base, n=1, max_new_tokens=budget, seed=[seed])
                handles.extend(engine.submit(prompt, sampling, sample=i, **options) for i in range(count))
            outputs = [handle.result() for handle in handles]
        except BaseException:
            for handle in handles:  # nothing of this call stays in flight (a model error, an interrupt)
                handle.abort()
            raise
        finally:
            engine.pause()
        samples = [(list(output.tokens), output.logprobs) for output in outputs]
        profile = Profile(
            route="async",
            output_tokens=sum(len(tokens) for tokens, _ in samples),
            max_active_rows=min(rows, self._size[0]),
            total_ms=(time.perf_counter() - started) * 1e3,
        )
        return samples, [AsyncCall(profile)]

    def _engine_for(self, model: Any, tokenizer: Any, config: RolloutConfig, rows: int, longest: int) -> AsyncEngine:
        """The engine, made again when the model or config changed or the call needs more than it holds."""
        max_batch = self.continuous_batch_size or rows
        if self.engine is not None and self._made_for == (model, config):
            held_rows, held_len = self._size
            if max_batch <= held_rows and longest <= held_len:
                return self.engine
            max_batch, longest = max(max_batch, held_rows), max(longest, held_len)
        self.close()
        positions = getattr(model.config, "max_position_embeddings", None)
        model_len = max(SMALLEST_MODEL_LEN, 1 << (longest - 1).bit_length())
        model_len = min(model_len, positions) if positions else model_len
        # the engine has no prefix cache across requests: a config's cache would only hold memory
        engine_config = replace(config, prefix_cache_mb=0.0)
        self.engine = AsyncEngine(model, tokenizer, engine_config, max_batch=max_batch, max_model_len=model_len)
        self.engine.pause()  # parked unless generating
        self._made_for, self._size = (model, config), (max_batch, model_len)
        return self.engine

    def _refresh_once_per_step(self, engine: AsyncEngine, step: int) -> None:
        """Repack the engine's weights once per optimizer step (while it is parked), for writes no
        version counter sees, as the synchronous path's `refresh_packs_once_per_step` does."""
        if self._refreshed_at_step != step:
            engine.rollout.refresh_weights()
            self._refreshed_at_step = step


def _refuse_sharded(trainer: Any) -> None:
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if getattr(trainer, "is_fsdp_enabled", False) or (plugin is not None and plugin.zero_stage == 3):
        raise ValueError(
            "engine='async' with a sharded model (FSDP or DeepSpeed ZeRO-3) is not supported: the engine's thread "
            "would run forwards outside the trainer's weight gathering; use engine='rollout'"
        )
