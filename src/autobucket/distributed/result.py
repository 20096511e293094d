"""What a `RayRollout.generate` call returns: the workers' results merged back into input order.

`DistributedResult` is a `RolloutResult` (same tokens / finish_reasons / route / profile) with the
per-worker reports and the imbalance properties. The merged `Profile` sums the workers' counters, phase
times (work, not wall time) and peak memory (each its own process's), takes the largest `capacity`, maps
`prefill_groups` to input indices (worker by worker), and sets `total_ms` to the wall time of the call."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from autobucket.planning.sharding import ShardPlan, imbalance
from autobucket.profile import Profile
from autobucket.result import RolloutResult

_SUMMED_FIELDS = (
    "prefill_forwards", "prefill_tokens", "decode_forwards", "plan_ms", "prefill_ms", "decode_ms", "cache_ms",
    "output_tokens", "kv_cache_bytes", "peak_memory_bytes", "trims", "trimmed_columns", "moved_bytes",
    "max_active_rows",
)  # fmt: skip


@dataclass
class WorkerReport:
    worker: int
    prompts: int
    predicted_ms: float  # the shard's summed `prompt_cost_ms`
    measured_ms: float  # the worker's own `Rollout.generate` wall time (0 for an empty shard)
    route: str = ""
    profile: Profile | None = None  # the worker's profile; its prefill_groups use shard-local indices


@dataclass
class DistributedResult(RolloutResult):
    workers: list[WorkerReport] = field(default_factory=list)
    sharding: str = "cost"

    @property
    def predicted_imbalance(self) -> float:
        return imbalance([report.predicted_ms for report in self.workers])

    @property
    def measured_imbalance(self) -> float:
        return imbalance([report.measured_ms for report in self.workers])


def merge_shard_results(
    plan: ShardPlan, results: dict[int, RolloutResult], count: int, want_logprobs: bool, config_route: str,
    sharding: str, started: float,
) -> DistributedResult:
    tokens: list = [None] * count
    reasons: list = [None] * count
    logprobs: list | None = [None] * count if want_logprobs else None
    reports = []
    for worker, shard in enumerate(plan.shards):
        result = results.get(worker)
        for local, index in enumerate(shard):
            tokens[index], reasons[index] = result.tokens[local], result.finish_reasons[local]
            if logprobs is not None:
                logprobs[index] = result.logprobs[local]
        reports.append(WorkerReport(
            worker, len(shard), plan.predicted_ms[worker], result.profile.total_ms if result else 0.0,
            result.route if result else "", result.profile if result else None,
        ))
    profile = _merge_profiles(plan, results, config_route)
    profile.total_ms = (time.perf_counter() - started) * 1e3
    profile.tokens_per_s = profile.output_tokens / max(profile.total_ms / 1e3, 1e-9)
    return DistributedResult(
        tokens=tokens, finish_reasons=reasons, route=profile.route, profile=profile, logprobs=logprobs,
        workers=reports, sharding=sharding,
    )


def _merge_profiles(plan: ShardPlan, results: dict[int, RolloutResult], config_route: str) -> Profile:
    profiles = {worker: result.profile for worker, result in results.items()}
    routes = {profile.route for profile in profiles.values()}
    merged = Profile(route=routes.pop() if len(routes) == 1 else (config_route if not routes else "distributed"))
    for name in _SUMMED_FIELDS:
        setattr(merged, name, sum(getattr(profile, name) for profile in profiles.values()))
    forwards = {profile.decode_forward for profile in profiles.values()}
    merged.decode_forward = forwards.pop() if len(forwards) == 1 else "+".join(sorted(forwards))
    merged.cache_capacity = max((profile.cache_capacity for profile in profiles.values()), default=0)
    for worker, profile in sorted(profiles.items()):
        shard = plan.shards[worker]
        merged.prefill_groups += [[[shard[i] for i in group] for group in admission]
                                  for admission in profile.prefill_groups]
    for name in ("estimated_ordinary_ms", "estimated_bucketed_ms"):
        values = [getattr(profile, name) for profile in profiles.values()]
        setattr(merged, name, sum(values) if values and None not in values else None)
    merged.decision_reason = "; ".join(
        f"worker {worker}: {profile.decision_reason}" for worker, profile in sorted(profiles.items())
        if profile.decision_reason
    )
    return merged
