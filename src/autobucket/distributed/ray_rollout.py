"""`RayRollout`: data-parallel rollout on Ray — one actor per worker, each holding one `Rollout`.

The actor body is `worker.Worker`. One `generate` call: prompts are normalised and checked on the
driver (so errors name the caller's prompt index), sharded by `plan_shards` over the cost model (a prompt and its n samples stay on one
worker), run on every worker at once, and merged back in input order. Tokens do not depend on the
sharding: greedy routes are token-exact per row, and sampling draws from streams keyed by each prompt's
request seed, which the driver derives from the *input* index and passes to the workers per prompt.

Design choices:

* **Result.** `DistributedResult` (see `result.py`) is a `RolloutResult` with per-worker
  reports (predicted and measured ms) and the imbalance properties; its route is the workers' common
  route, or "distributed" when they differ.
* **Geometry and costs** for sharding come from worker 0 once (`describe`), cached until the model
  factory changes: the driver never loads weights.
* **Failures.** A worker's exception reaches the caller as Ray's `RayTaskError`, which is also an
  instance of the original type (`except ValueError` works) and carries the worker's traceback. The
  other shards are cancelled: Ray sets a flag that a forward pre-hook in each worker checks, so a
  cancelled shard stops at its next forward. A dead actor is replaced by a fresh one (same factory,
  then the latest `update_weights` state dict) *before* the error is raised, so the next call works.
  Ray's own `max_restarts` is not used: it would rerun the constructor and lose updated weights.
* **Actor lifetime.** Actors die with `shutdown()`, at the end of a `with` block, or when the last
  handle is garbage-collected (they are not detached). Ray itself is started only when it is not
  running, and is left running.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from autobucket.checks import optional_int, require_int
from autobucket.config import RolloutConfig, SamplingConfig, sampling_or_default
from autobucket.costs.coefficients import CostCoefficients
from autobucket.distributed.result import DistributedResult, merge_shard_results
from autobucket.distributed.worker import ModelFactory, Worker, WorkerInfo
from autobucket.planning.sharding import STRATEGIES, ShardPlan, plan_shards, prompt_cost_ms
from autobucket.prompts import check_context, is_conversation, normalize_prompts, unpad_left_padded
from autobucket.result import RolloutResult

_CANCEL_WAIT_S = 60.0  # most time to wait for cancelled shards to stop before raising the first error


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise ImportError(
            'RayRollout needs Ray, which is not installed: pip install "autobucket[ray]" (or pip install "ray>=2.9")'
        ) from error
    return ray


class RayRollout:
    """Data-parallel `Rollout` over Ray actors.

    >>> with RayRollout("bench-qwen2", num_workers=2) as rr:
    ...     result = rr.generate(prompts, SamplingConfig(max_new_tokens=16))

    model_factory: a picklable callable returning (model, tokenizer) or a bare model, built inside each
      worker; or a string for `autobucket.load_model` (tiny name, smollm2, folder, HF id, config.json).
      A path that does not exist is refused here, before any actor starts.
    config: every worker's `RolloutConfig` (None: the defaults, route "auto" with online costs).
    worker_options: Ray actor options (`num_cpus`, `num_gpus`, `resources`, `runtime_env`, ...);
      `num_cpus` defaults to 1.
    torch_threads: `torch.set_num_threads` in each worker; None: the actor's `num_cpus` (an int).
    sharding: "cost" (balance the cost model's estimate) or "round_robin".
    """

    def __init__(
        self,
        model_factory: ModelFactory,
        num_workers: int = 2,
        config: RolloutConfig | None = None,
        worker_options: Mapping[str, Any] | None = None,
        torch_threads: int | None = None,
        sharding: str = "cost",
    ) -> None:
        self._ray = _import_ray()
        require_int("num_workers", num_workers, fix="pass the number of Ray actors to start")
        optional_int("torch_threads", torch_threads, fix="pass None to use each actor's num_cpus")
        if sharding not in STRATEGIES:
            raise ValueError(f"sharding={sharding!r} is invalid: choose one of {', '.join(STRATEGIES)}")
        self.config = config if config is not None else RolloutConfig()
        if not isinstance(self.config, RolloutConfig):
            raise TypeError(f"config must be a RolloutConfig, got {type(self.config).__name__}")
        _check_factory(model_factory)
        self.num_workers, self.sharding = num_workers, sharding
        self._options = {"num_cpus": 1, **(worker_options or {})}
        self._threads = torch_threads if torch_threads is not None else _default_threads(self._options)
        self._factory, self._state_ref = model_factory, None
        self._info: WorkerInfo | None = None
        self._learned: CostCoefficients | None = None  # online-learned costs of the last call's workers
        if not self._ray.is_initialized():
            self._ray.init()
        self._actor_class = self._ray.remote(Worker)
        self._actors: list[Any] = [None] * num_workers
        self._loading: list[Any] = []  # refs of load tasks not yet confirmed
        for worker in range(num_workers):
            self._start(worker)

    # ---------------------------------------------------------------- public API
    def generate(
        self, prompts: Sequence[Any], sampling: SamplingConfig | None = None, **overrides: Any
    ) -> DistributedResult:
        """Like `Rollout.generate`; returns a `DistributedResult` in input order."""
        started = time.perf_counter()
        sampling = sampling_or_default(sampling)
        info = self.worker_info()
        if self._learned is not None:  # shard with what the workers learned in the last call
            info = self._info = replace(info, costs=self._learned)
            self._learned = None
        token_prompts = self._normalize(prompts, info)
        budgets = sampling.request_budgets(len(token_prompts))
        check_context(token_prompts, budgets, info.max_positions)
        unit_costs = [
            prompt_cost_ms(len(p), budget, info.geometry, info.costs, sampling.n)
            for p, budget in zip(token_prompts, budgets, strict=True)
        ]
        plan = plan_shards(unit_costs, self.num_workers, self.sharding)
        results = self._run_shards(plan, token_prompts, sampling, overrides)
        self._learned = _learned_costs(results.values())
        return merge_shard_results(
            plan, results, len(token_prompts), sampling.logprobs, self.config.route, self.sharding, started
        )

    def generate_padded(
        self,
        input_ids: torch.Tensor | np.ndarray,
        attention_mask: torch.Tensor | np.ndarray,
        sampling: SamplingConfig | None = None,
        **overrides: Any,
    ) -> DistributedResult:
        """The RL-trainer layout: left-padded `[batch, width]` ids and mask (tensors or numpy arrays)."""
        return self.generate(unpad_left_padded(input_ids, attention_mask), sampling, **overrides)

    def update_weights(self, state_dict_or_factory: Mapping[str, torch.Tensor] | ModelFactory) -> None:
        """Load a state dict on every worker (one `ray.put`), or rebuild every worker's model from a factory.

        The last state dict stays in Ray's object store (one CPU copy) so a replaced worker gets it too.
        """
        self._check_open()
        if isinstance(state_dict_or_factory, Mapping):
            # CPU copies: a trainer's GPU tensors must not need a GPU to deserialise on a worker.
            state = {name: tensor.detach().cpu() for name, tensor in state_dict_or_factory.items()}
            self._state_ref = self._ray.put(state)
            refs = self._loading + [actor.load_state_dict.remote(self._state_ref) for actor in self._actors]
        else:  # pending loads of the old factory are superseded: a failed one must not block the fix
            _check_factory(state_dict_or_factory)
            self._factory, self._state_ref, self._info, self._learned = state_dict_or_factory, None, None, None
            refs = [actor.load.remote(self._factory) for actor in self._actors]
        self._loading = []
        self._ray.get(refs)

    def worker_info(self) -> WorkerInfo:
        """Geometry, costs and limits of the workers' model (asked of worker 0 once; waits for loads)."""
        self._check_open()
        if self._loading:
            self._ray.get(self._loading)  # a failing factory raises here, with its own exception type
            self._loading = []
        if self._info is None:
            self._info = self._ray.get(self._actors[0].describe.remote())
        return self._info

    def shutdown(self) -> None:
        """Kill every worker actor; the object cannot be used afterwards."""
        for actor in self._actors:
            if actor is not None:
                self._ray.kill(actor)
        self._actors, self._loading = [], []

    def __enter__(self) -> RayRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- workers
    def _start(self, worker: int) -> None:
        """Create (or replace) one actor and queue its model load: factory, then the latest state dict."""
        if self._actors[worker] is not None:
            self._ray.kill(self._actors[worker])
        actor = self._actor_class.options(**self._options).remote(self.config, self._threads)
        self._actors[worker] = actor
        self._loading.append(actor.load.remote(self._factory))
        if self._state_ref is not None:
            self._loading.append(actor.load_state_dict.remote(self._state_ref))

    def _check_open(self) -> None:
        if not self._actors:
            raise RuntimeError("this RayRollout was shut down: create a new one")

    def _normalize(self, prompts: Sequence[Any], info: WorkerInfo) -> list[list[int]]:
        """Token lists for the whole batch; strings and chat messages are tokenised by worker 0, which holds
        the tokenizer."""
        is_list = isinstance(prompts, Sequence) and not isinstance(prompts, (str, torch.Tensor))
        if is_list and any(isinstance(prompt, str) or is_conversation(prompt) for prompt in prompts):
            return self._ray.get(self._actors[0].normalize.remote(list(prompts)))
        return normalize_prompts(prompts, None, info.vocab_size)

    def _run_shards(
        self, plan: ShardPlan, prompts: list[list[int]], sampling: SamplingConfig, overrides: dict
    ) -> dict[int, RolloutResult]:
        """Run every non-empty shard at once; on the first failure cancel the rest, heal, re-raise. Each
        shard's prompts keep the stream keys and budgets of the caller's single call (`subset_sampling`),
        and their indices in it (a `prefix_allowed_tokens_fn`'s batch id), so sampled tokens do not depend
        on the sharding. Logits processors travel by value (cloudpickle): a stateful one's state stays
        in its worker's copy."""
        from autobucket.engine.sampling.streams import subset_sampling

        owner = {}
        for worker, shard in enumerate(plan.shards):
            if shard:
                shard_sampling = subset_sampling(sampling, shard, len(prompts))
                ref = self._actors[worker].generate.remote([prompts[i] for i in shard], shard_sampling, overrides, shard)
                owner[ref] = worker
        results: dict[int, RolloutResult] = {}
        pending = list(owner)
        while pending:
            try:
                (ready,), pending = self._ray.wait(pending, num_returns=1)
            except KeyboardInterrupt:  # the driver was interrupted: stop the workers too
                for ref in pending:
                    self._ray.cancel(ref)
                raise
            try:
                results[owner[ready]] = self._ray.get(ready)
            except Exception as error:
                self._recover(owner[ready], error, pending, owner)
                if hasattr(error, "add_note"):
                    error.add_note(f"raised by RayRollout worker {owner[ready]}; the other shards were cancelled")
                raise
        return results

    def _recover(self, failed: int, error: Exception, pending: list[Any], owner: dict[Any, int]) -> None:
        """Cancel the other shards, wait for them to stop, and replace every actor that died."""
        actor_died = self._ray.exceptions.RayActorError
        dead = {failed} if isinstance(error, actor_died) else set()
        for ref in pending:
            self._ray.cancel(ref)
        for ref in pending:
            try:
                self._ray.get(ref, timeout=_CANCEL_WAIT_S)
            except actor_died:
                dead.add(owner[ref])
            except Exception:  # noqa: BLE001 - cancelled or failed too; the first error is the one reported
                pass
        for worker in sorted(dead):
            self._start(worker)


def _learned_costs(results: Any) -> CostCoefficients | None:
    """The per-coefficient median of the costs online-learning workers planned with (None if none learn)."""
    learned = [r.profile.costs for r in results if r.profile.costs_source in ("probe", "stored", "online")]
    if not learned:
        return None
    return CostCoefficients(**{name: statistics.median(c[name] for c in learned) for name in learned[0]})


def _check_factory(factory: Any) -> None:
    """On the driver, before any actor starts: a factory must be callable, or a model name that can exist
    (a path that does not exist is refused here, naming it, instead of failing in every worker)."""
    from autobucket.models import check_model_name

    if isinstance(factory, str):
        check_model_name(factory)
    elif not callable(factory):
        raise TypeError(
            f"model_factory must be a callable returning (model, tokenizer) or a model name/path string, "
            f"got {type(factory).__name__}"
        )


def _default_threads(options: Mapping[str, Any]) -> int:
    cpus = options.get("num_cpus", 1)
    return max(int(cpus), 1) if isinstance(cpus, (int, float)) else 1
