"""Shared prefixes inside one admission: prompts that begin with the same tokens (a system prompt, a
few-shot header) can prefill that prefix once and continue each prompt from its K/V, instead of
prefilling it once per prompt. Pure: token ids and the cost model only.

`find_shared_prefixes` sorts the prompts lexicographically, so prompts with a common start are
neighbours, and takes maximal runs whose common prefix stays at least `min_tokens` long (each member
keeps at least its last token to prefill: its logits start generation). `plan_shared_prefixes` keeps
the runs the cost model says pay: one forward of the prefix plus the continued suffixes (their
attention to the prefix and the prefix's K/V copy into every row included) against the padded-bucket
plan of the whole prompts, both without the token budget (an estimate, not a schedule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from autobucket.costs.coefficients import (
    CostCoefficients,
    ModelGeometry,
    attention_gflops,
    kv_mib,
    prefill_cost_ms,
)
from autobucket.planning.planner import plan_prefill

MIN_SHARED_TOKENS = 32  # shorter common starts (chat-template tokens) are not worth a forward of their own


@dataclass(frozen=True)
class SharedPrefix:
    """Prompts (positions in the list given) whose first `tokens` tokens are the same."""

    members: tuple[int, ...]
    tokens: int
    saving_ms: float = 0.0  # the cost model's estimate (set by `plan_shared_prefixes`)


def find_shared_prefixes(prompts: Sequence[Sequence[int]], min_tokens: int = MIN_SHARED_TOKENS) -> list[SharedPrefix]:
    """Maximal runs of two or more prompts sharing at least `min_tokens` leading tokens."""
    order = sorted(range(len(prompts)), key=lambda index: tuple(prompts[index]))
    found: list[SharedPrefix] = []
    run, common = [], 0
    for index in order:
        prompt = prompts[index]
        joined = min(common, _common_length(prompts[run[-1]], prompt), len(prompt) - 1) if run else len(prompt) - 1
        if run and joined >= min_tokens:
            run.append(index)
            common = joined
            continue
        if len(run) > 1:
            found.append(SharedPrefix(tuple(sorted(run)), common))
        run, common = [index], len(prompt) - 1
    if len(run) > 1:
        found.append(SharedPrefix(tuple(sorted(run)), common))
    return found


def shared_prefix_saving_ms(
    prefix: SharedPrefix,
    lengths: Sequence[int],
    geometry: ModelGeometry,
    costs: CostCoefficients,
    samples_per_prompt: int = 1,
) -> float:
    """Estimated ms saved by prefilling `prefix` once (negative: it costs more). `lengths` are the
    members' whole prompt lengths, in `prefix.members` order."""
    whole_ms = plan_prefill(lengths, geometry, costs, None, samples_per_prompt).cost_ms
    suffixes = [length - prefix.tokens for length in lengths]
    rows = len(lengths) * samples_per_prompt
    shared_ms = prefill_cost_ms(1, prefix.tokens, geometry, costs, include_kv_copy=False)
    shared_ms += plan_prefill(suffixes, geometry, costs, None, samples_per_prompt).cost_ms
    # each suffix token also attends to the prefix's keys; the prefix's K/V is copied into every row
    pair_gflops = attention_gflops(1, 1, geometry)
    shared_ms += costs.attention_ms * pair_gflops * sum(suffixes) * prefix.tokens
    shared_ms += costs.kv_ms * kv_mib(rows, prefix.tokens, geometry)
    return whole_ms - shared_ms


def plan_shared_prefixes(
    prompts: Sequence[Sequence[int]],
    geometry: ModelGeometry,
    costs: CostCoefficients,
    samples_per_prompt: int = 1,
    min_tokens: int = MIN_SHARED_TOKENS,
) -> list[SharedPrefix]:
    """The shared prefixes worth prefilling once under the cost model, with what each saves."""
    planned = []
    for prefix in find_shared_prefixes(prompts, min_tokens):
        lengths = [len(prompts[m]) for m in prefix.members]
        saving_ms = shared_prefix_saving_ms(prefix, lengths, geometry, costs, samples_per_prompt)
        if saving_ms > 0:
            planned.append(replace(prefix, saving_ms=saving_ms))
    return planned


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return common
