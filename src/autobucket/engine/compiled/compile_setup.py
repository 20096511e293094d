"""Glue between a call's route and the compiled decode step: decide (planning.compile_choice), build
the `CompiledDecode` a `ModelRunner` uses, and copy what it did into the profile."""

from __future__ import annotations

import torch

from autobucket.costs.decode_figures import CompileFigures
from autobucket.engine.compiled.compiled_decode import (
    CompiledDecode,
    decode_graphs,
    hooks_epoch,
    predicted_graph_keys,
    store_columns,
)
from autobucket.planning.compile_choice import CompileDecision, choose_compile
from autobucket.profile import Profile


def compile_decision(
    model: torch.nn.Module,
    setting: bool | str,
    rows: int,
    items: int,
    longest: int,
    max_new_tokens: int,
    capacity: int,
    round_capacity: bool = True,
    figures: CompileFigures | None = None,
) -> CompileDecision:
    """The decision for a CB call with `items` rows to decode, `rows` at once, on a `capacity`-column cache;
    `round_capacity` as for `compiled_decode_for` (False: an explicit cache_capacity, kept exactly), so the
    predicted graph keys are the ones the call's store will really have; `figures`: what was measured on
    the device (the eager step probed first where "auto" weighs new graphs), else the prior's."""
    hooks = hooks_epoch(model) if setting is not False else 0  # a module walk only where graphs may run
    keys = predicted_graph_keys(rows, longest, max_new_tokens, store_columns(capacity, round_capacity), hooks)
    new_graphs = len(keys - decode_graphs(model).shapes)
    waves = -(-items // rows)
    parameters = sum(p.numel() for p in model.parameters())
    measured = figures.measured(rows, probe=setting == "auto" and new_graphs > 0) if figures is not None else None
    return choose_compile(setting, parameters, rows, waves * max(max_new_tokens - 1, 0), new_graphs, measured=measured)


def compiled_decode_for(
    model: torch.nn.Module, cache_keyword: str, decision: CompileDecision, profile: Profile, round_capacity: bool
) -> CompiledDecode | None:
    """The call's compiled step, or None; `round_capacity` False keeps an explicit cache_capacity as given."""
    profile.compile_decision = decision.reason
    if not decision.use_compiled:
        return None
    compiled = CompiledDecode(model, cache_keyword, decision.compile_new, round_capacity)
    profile.compile_fallback = compiled.stats.fallback_reason
    return compiled


def record_compile(profile: Profile, compiled: CompiledDecode | None) -> None:
    """Move compile time out of decode time and copy the counters."""
    if compiled is None:
        return
    stats = compiled.stats
    profile.compile_ms += stats.compile_ms
    profile.decode_ms = max(0.0, profile.decode_ms - stats.compile_ms)
    profile.compiled_graphs += stats.new_graphs
    profile.recompiles += stats.recompiles
    profile.compiled_steps += stats.compiled_steps
    profile.eager_steps += stats.eager_steps
    profile.compile_fallback = stats.fallback_reason


def compile_credit_ms(decision: CompileDecision) -> float:
    """What compiling takes off the continuous-batching estimate (ordinary `generate` is never compiled):
    the predicted saving, less the compile time when new graphs will be compiled; 0 when no graph runs."""
    if not decision.use_compiled:
        return 0.0
    if decision.compile_new:
        return decision.saving_ms - decision.compile_ms
    return decision.saving_ms if decision.compile_ms == 0.0 else 0.0
