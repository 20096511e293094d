"""Random streams keyed by a request's identity, so a sample does not depend on its batch or route.

Why not torch's generator: HF `generate` draws every row's sample from one global generator, so a
row's tokens depend on how many rows were drawn before it — on batch composition, route and refill
order. Here each draw uses one uniform number `u = stream(seed, prompt, sample, step)`, a pure hash
of the request's identity and the step (splitmix64), and picks the token by inverse CDF over the warped
distribution (`inverse_cdf.py`). The same request gets the same `u` on every route, and a tiny logit
difference between routes can only change the token if `u` falls within that difference of a CDF
boundary."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from autobucket.config import SamplingConfig

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


def stream_uniforms(seeds: Sequence[int], samples: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    """One uniform in [0, 1) per row, a pure function of (seed, sample index, step).

    `seeds` is each row's request seed: the call's seed mixed with the prompt index, or a per-prompt
    seed the caller chose (which keeps a prompt's samples independent of its position in the batch).
    """
    with np.errstate(over="ignore"):
        # Each key is finalised on its own before it is combined: combining raw keys first
        # (e.g. (seed + c) ^ sample) makes distinct (seed, sample) pairs collide.
        state = _splitmix64(np.asarray(seeds, dtype=np.uint64) + _GOLDEN_GAMMA)
        for lane, counter in enumerate((samples, steps), start=2):
            key = _splitmix64(np.asarray(counter, dtype=np.uint64) + _GOLDEN_GAMMA * np.uint64(lane))
            state = _splitmix64(state + key)
    return (state >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def request_seed(call_seed: int, prompt_index: int) -> int:
    """The stream key of prompt `prompt_index` under one call-wide seed."""
    with np.errstate(over="ignore"):
        seed = _splitmix64(np.asarray([call_seed], dtype=np.uint64) + _GOLDEN_GAMMA)
        index = _splitmix64(np.asarray([prompt_index], dtype=np.uint64) + _GOLDEN_GAMMA * np.uint64(5))
        mixed = _splitmix64(seed + index)
    return int(mixed[0])


def request_seeds(seed: int | Sequence[int], prompt_count: int) -> tuple[int, ...]:
    """Every prompt's stream key for one call: a per-prompt list as given, or derived from one int
    and each prompt's *input* index (a wrapper that reorders or shards prompts must pass these on)."""
    if isinstance(seed, (list, tuple)):
        if len(seed) != prompt_count:
            raise ValueError(f"seed has {len(seed)} values for {prompt_count} prompts: pass one per prompt or one int")
        return tuple(seed)
    return tuple(request_seed(seed, index) for index in range(prompt_count))



def subset_sampling(sampling: SamplingConfig, indices: Sequence[int], prompt_count: int) -> SamplingConfig:
    """`sampling` for the prompts at `indices` of a call of `prompt_count` prompts (a shard or a chunk): each
    keeps the stream key and the budget it has in the whole call, so its tokens do not depend on the split."""
    seeds = request_seeds(sampling.seed, prompt_count)
    budget = sampling.max_new_tokens
    if isinstance(budget, list):
        budgets = sampling.request_budgets(prompt_count)
        budget = [budgets[i] for i in indices]
    return dataclasses.replace(sampling, seed=[seeds[i] for i in indices], max_new_tokens=budget)
