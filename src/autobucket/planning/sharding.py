"""Assign prompt groups to data-parallel workers (pure Python, never imports torch or ray).

**Unit.** The shard unit is a *prompt group*: one prompt and its n samples (`SamplingConfig.n`). A group
is never split, so its worker prefills the prompt once and shares the KV among the n rows.

**Cost of a group.** The cost model prices prefill buckets and the *differences* between routes; it has
no absolute decode term. A prompt of L tokens that generates T tokens is therefore priced as a singleton
prefill of its whole sequence, ``prefill_cost_ms(1, L + T - 1)``: the prompt's own singleton prefill plus
each of the T - 1 decode steps priced as the token at that position costs in a prefill (the row cost's
increase from L to L + T - 1). A group of n samples pays the prefill once and the decode share n
times. Two deliberate simplifications:

* the singleton's ``fixed_ms`` is charged per prompt although a worker shares it over a bucket; it stands
  in for the per-forward cost of decode steps, which a worker with more rows pays in more waves;
* a decode token is charged like a prefill token, which underestimates decode on a CPU (memory-bound
  steps) and so weighs long prompts a little more than their measured share.

Both are uniform over prompts, so they shift the balance only through the long/short mix; measured
imbalance is reported next to the predicted one so a bad estimate shows. The absolute prediction can
be well off a worker's time while the predicted imbalance still matches the measured one
(docs/benchmarks.md): the relative costs are what balancing needs.

**Balancing.** Longest-processing-time greedy: groups by cost, descending, each to the currently
cheapest worker. Its makespan is within ``4/3 - 1/(3·workers)`` of the optimum (Graham 1969) and is
near-optimal when there are many small groups (RL batches); it runs in O(n log n). Ties go to the lower
index, so a plan is deterministic.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from autobucket.checks import require_int
from autobucket.costs.coefficients import CostCoefficients, ModelGeometry, prefill_cost_ms

STRATEGIES = ("cost", "round_robin")


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Per worker: the group indices it runs (ascending) and their summed predicted ms."""

    shards: tuple[tuple[int, ...], ...]
    predicted_ms: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        return imbalance(self.predicted_ms)


def imbalance(loads_ms: Sequence[float]) -> float:
    """max / mean over workers (1.0 is perfect; 1.0 too when every load is zero)."""
    if not loads_ms:
        return 1.0
    mean_ms = sum(loads_ms) / len(loads_ms)
    return max(loads_ms) / mean_ms if mean_ms > 0 else 1.0


def prompt_cost_ms(
    length: int, max_new_tokens: int, geometry: ModelGeometry, costs: CostCoefficients, samples: int = 1
) -> float:
    """Estimated ms of one prompt group on a worker: its prompt's singleton prefill plus, per sample,
    the decode share; with one sample that is a singleton prefill of prompt + generated tokens."""
    prefill_ms = prefill_cost_ms(1, length, geometry, costs)
    decode_ms = prefill_cost_ms(1, length + max_new_tokens - 1, geometry, costs) - prefill_ms
    return prefill_ms + samples * decode_ms


def plan_shards(group_costs_ms: Sequence[float], num_workers: int, strategy: str = "cost") -> ShardPlan:
    """Assign each group (by index) to one of ``num_workers`` workers.

    strategy "cost": longest-processing-time greedy on the costs; "round_robin": group i to worker
    i % num_workers (the baseline, blind to cost).
    """
    _check_workers(num_workers)
    costs = [_checked_cost(index, value) for index, value in enumerate(group_costs_ms)]
    if strategy == "cost":
        owners = _longest_first(costs, num_workers)
    elif strategy == "round_robin":
        owners = [index % num_workers for index in range(len(costs))]
    else:
        raise ValueError(f"strategy={strategy!r} is invalid: choose one of {', '.join(STRATEGIES)}")
    shards: list[list[int]] = [[] for _ in range(num_workers)]
    for index, owner in enumerate(owners):
        shards[owner].append(index)
    loads = tuple(sum(costs[index] for index in shard) for shard in shards)
    return ShardPlan(tuple(tuple(shard) for shard in shards), loads)


def _longest_first(costs: list[float], num_workers: int) -> list[int]:
    """Owner of each group under LPT greedy; the heap holds (load, worker) so ties pick the lower worker."""
    owners = [0] * len(costs)
    heap = [(0.0, worker) for worker in range(num_workers)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, worker = heapq.heappop(heap)
        owners[index] = worker
        heapq.heappush(heap, (load + costs[index], worker))
    return owners


def _check_workers(num_workers: int) -> None:
    require_int("num_workers", num_workers, 1, "use at least one worker")


def _checked_cost(index: int, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"group {index} has cost {value!r}: costs must be finite numbers >= 0 (ms)")
    return float(value)
