"""The routes: one signature (`RouteCall -> finished results`), registered in `ROUTES`.

A route receives everything it needs in a `RouteCall` (the model, how to call its forward, its
geometry, the coefficients, the configs and the resolved generation) and never reaches back into the
`Rollout`. The continuous-batching routes differ only in their admission policy (`admission.py`),
which splits each admission's prompts into prefill groups; `ContinuousBatcher` does the rest:

- `equal_width`: one padded group per admission; `aligned`: one group per prompt;
- `bucketed`: the forms planner's groups (padded, packed or chunked);
- `auto`: `choose_route` per call picks `ordinary` or `bucketed` from the cost model, and the
  decision's plan serves the first admission. Auto never retries another route: a model error or
  out-of-memory in the chosen route propagates as it is.

The compile decision is made once per call (`with_compile_decision`) and carried in the `RouteCall`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

from autobucket.config import RolloutConfig
from autobucket.engine.admission import (
    PlannedGroups,
    aligned_groups,
    continued_aligned,
    continued_equal_width,
    continued_planned,
    decision_groups,
    equal_width_groups,
    form_options,
)
from autobucket.engine.batching.batcher import AdmissionPolicy, ContinuousBatcher
from autobucket.engine.batching.model_runner import SHARED_PREFIX_MIN_SAVED_COLUMNS, CacheShape, ModelRunner
from autobucket.engine.batching.prefix_reuse import PrefixReuse
from autobucket.engine.compiled.compile_setup import (
    compile_credit_ms,
    compile_decision,
    compiled_decode_for,
    record_compile,
)
from autobucket.engine.intercept.active import active
from autobucket.engine.intercept.attention import AttentionFunction, dispatches, sliding_windows_applied
from autobucket.engine.model_access.hf_compat import attention_implementation, continuous_batching_refusal
from autobucket.engine.ordinary import run_ordinary
from autobucket.engine.plan.forward_plan import ForwardPlan
from autobucket.engine.plan.ops import DECODE_ATTENTION
from autobucket.engine.request import Request
from autobucket.engine.route_call import RouteCall
from autobucket.planning.compile_choice import CompileDecision, choose_compile
from autobucket.planning.route_choice import (
    ROUTE_BUCKETED,
    ROUTE_ORDINARY,
    RouteDecision,
    choose_route,
)
from autobucket.planning.shared_prefix import plan_shared_prefixes
from autobucket.profile import Profile

FinishedItems = dict[tuple[int, int], Request]  # (prompt index, sample index) -> its finished record


Route = Callable[[RouteCall], FinishedItems]
# How a route groups its prefix-cache hits: (call, prompt indices, suffix lengths) -> groups of indices.
ContinuationPolicy = Callable[[RouteCall, Sequence[int], Sequence[int]], list[list[int]]]


# ------------------------------------------------------------------ the routes
def ordinary_route(call: RouteCall) -> FinishedItems:
    return run_ordinary(call.model, call.prompts, call.sampling, call.profile, call.timer, call.stops)


def equal_width_route(call: RouteCall) -> FinishedItems:
    return run_continuous(call, lambda admitted: equal_width_groups(call, admitted), continued_equal_width)


def aligned_route(call: RouteCall) -> FinishedItems:
    return run_continuous(call, lambda admitted: aligned_groups(call, admitted), continued_aligned)


def bucketed_route(call: RouteCall) -> FinishedItems:
    return run_continuous(call, PlannedGroups(call, first_plan=None), share_prefixes=True)


def auto_route(call: RouteCall) -> FinishedItems:
    started = time.perf_counter()
    refusal = continuous_batching_refusal(call.model) or _window_refusal(call)
    if refusal is not None:
        return _ordinary_instead(call, refusal)
    if call.prefix_cache is not None:
        # Ordinary `generate` neither reads nor fills the prefix cache; continuous batching does both.
        cached = sum(call.prefix_cache.cached_length(p) > 0 for p in call.prompts)
        call.profile.route = ROUTE_BUCKETED
        call.profile.decision_reason = (
            f"the prefix cache is on ({cached} of {len(call.prompts)} prompts have a cached prefix): continuous "
            "batching prefills only what is not cached and caches the finished sequences"
        )
        return run_continuous(call, PlannedGroups(call, first_plan=None), share_prefixes=True)
    decision = choose_route(
        [len(p) for p in call.prompts],
        call.most_new_tokens,  # the decode steps run until the largest budget, on either route
        call.sampling.continuous_batch_size,
        call.geometry,
        call.costs,
        prefill_max_tokens=call.config.prefill_max_tokens,
        max_positions=call.max_positions,
        ordinary_blocked_reason=_ordinary_blocked_reason(call.config),
        samples_per_prompt=call.sampling.n,
        forms=form_options(call),
        shared_saving_ms=_shared_saving_ms(call),
    )
    decision = _with_compile_credit(call, decision)
    profile = call.profile
    profile.plan_ms += (time.perf_counter() - started) * 1e3
    profile.route = decision.route
    profile.estimated_ordinary_ms = decision.ordinary_ms
    profile.estimated_bucketed_ms = decision.bucketed_ms
    profile.decision_reason = decision.reason
    if decision.route == ROUTE_ORDINARY:
        profile.prefill_groups = [[list(range(len(call.prompts)))]]
        return ordinary_route(call)
    fits_first_admission = len(call.prompts) * call.sampling.n <= call.sampling.continuous_batch_size
    first = decision_groups(decision, call.config.prefill_max_tokens) if fits_first_admission else None
    return run_continuous(call, PlannedGroups(call, first), share_prefixes=True)


ROUTES: dict[str, Route] = {
    "ordinary": ordinary_route,
    "equal_width": equal_width_route,
    "aligned": aligned_route,
    "bucketed": bucketed_route,
    "auto": auto_route,
}


PLANNING_ROUTES = ("bucketed", "auto")  # the routes that read the cost coefficients


def _shared_saving_ms(call: RouteCall) -> float:
    """What sharing prefixes saves if the whole call were one admission (0 when sharing is off)."""
    if not call.config.share_prefixes:
        return 0.0
    shared = plan_shared_prefixes(call.prompts, call.geometry, call.costs, call.sampling.n)
    return sum(prefix.saving_ms for prefix in shared)


def _with_compile_credit(call: RouteCall, decision: RouteDecision) -> RouteDecision:
    """One decision: a compiled decode step makes bucketed CB cheaper, never ordinary `generate`.
    Applies when the DP ran (a skipped DP means ordinary won by a margin the lower bound proved)."""
    if decision.route != ROUTE_ORDINARY or decision.bucketed_ms is None or call.config.compile is False:
        return decision
    credit = compile_credit_ms(call.compile_decision)
    if decision.bucketed_ms - credit >= decision.ordinary_ms:
        return decision
    reason = (
        f"bucketed with the compiled decode step estimated cheaper ({decision.bucketed_ms:.1f} ms - "
        f"{credit:.1f} ms compile credit < ordinary {decision.ordinary_ms:.1f} ms)"
    )
    return dataclasses.replace(decision, route=ROUTE_BUCKETED, reason=reason)


def _ordinary_blocked_reason(config: RolloutConfig) -> str | None:
    if config.cache_capacity is not None:
        return f"an explicit cache_capacity={config.cache_capacity} was requested"
    if config.trim_cache:
        return "trim_cache=True was requested"
    return None


# ------------------------------------------------------------------ the CB schedule
def run_continuous(
    call: RouteCall,
    admission_policy: AdmissionPolicy,
    continuation: ContinuationPolicy = continued_planned,
    share_prefixes: bool = False,
) -> FinishedItems:
    """One call's CB schedule; `share_prefixes`: the planning routes may prefill a prefix shared inside
    an admission once (when `RolloutConfig.share_prefixes` and the cost model agree)."""
    attention_implementation(call.model)
    windowed = _check_sliding_window(call)
    shape = cache_shape(call)
    call.profile.cache_capacity = shape.cache_capacity
    assert call.compile_decision is not None, "a CB route runs on a call with its compile decision"
    compiled = compiled_decode_for(
        call.model,
        call.spec.cache_keyword,
        call.compile_decision,
        call.profile,
        round_capacity=call.config.cache_capacity is None,
    )
    runner = ModelRunner(
        call.model,
        call.spec,
        shape,
        call.sampling.pad_token_id,
        call.vocab_size,
        track_seen=call.sampling.selection.uses_penalty,
        trim_cache=call.config.trim_cache,
        compiled=compiled,
        shared_prefix=_shared_prefix_allowed(call),
        samples_share_prompt=_shares_samples_kv(call),
        decode_attention=_decode_attention(call),
    )
    call.profile.decode_forward = "direct" if runner.parts is not None else "model"
    batcher = ContinuousBatcher(
        runner,
        call.sampling,
        call.profile,
        call.timer,
        _prefix_reuse(call, continuation, share_prefixes and call.config.share_prefixes),
        call.stops,
    )
    evicted = call.prefix_cache.stats.evicted_blocks if call.prefix_cache is not None else 0
    with sliding_windows_applied() if windowed else contextlib.nullcontext():
        finished = batcher.run(call.prompts, call.sampling.n, admission_policy)
    _record_cache(call.profile, runner)
    if call.prefix_cache is not None:
        call.profile.prefix_cache_evictions = call.prefix_cache.stats.evicted_blocks - evicted
        call.profile.prefix_cache_bytes = call.prefix_cache.used_bytes
    record_compile(call.profile, compiled)
    if call.compile_figures is not None:
        call.compile_figures.record_call(call.profile)  # the steps and compiles the next decisions read
    return finished


def _decode_attention(call: RouteCall) -> AttentionFunction | None:
    return eager_decode_attention(active().plan)


def eager_decode_attention(plan: ForwardPlan) -> AttentionFunction | None:
    """The attention the eager decode steps ask for: the plan's decode attention where a backend other
    than the kernel set's runs it (the C++ decode kernel, which reads only each row's own keys), else
    None (the forward's own attention: transformers' SDPA, or the kernel set's)."""
    return plan.function(DECODE_ATTENTION) if plan.kernel_set == "torch" else None


def _shared_prefix_allowed(call: RouteCall) -> bool:
    """Rows may read one shared copy of K/V where the plan runs shared-prefix attention (the model's
    attention goes through transformers' interface, and the kernel set has the kernel). A prefix shared
    inside an admission is shared when its members save SHARED_PREFIX_MIN_SAVED_COLUMNS (`ModelRunner`); a
    call past the model's sliding window shares too (a sliding layer's rows read the shared keys their
    window still covers)."""
    return active().plan.shares_prefixes


def _shares_samples_kv(call: RouteCall) -> bool:
    """A prompt's n samples read one copy of its K/V when the copies saved over the call ((samples
    decoded at once - 1) x prompt tokens) pass SHARED_PREFIX_MIN_SAVED_COLUMNS."""
    together = min(call.sampling.n, call.sampling.continuous_batch_size)
    return together > 1 and (together - 1) * sum(len(p) for p in call.prompts) >= SHARED_PREFIX_MIN_SAVED_COLUMNS


def _prefix_reuse(call: RouteCall, continuation: ContinuationPolicy, share: bool) -> PrefixReuse | None:
    if call.prefix_cache is None and not share:
        return None
    return PrefixReuse(
        call.prefix_cache,
        lambda indices, suffixes: continuation(call, indices, suffixes),
        call.config.prefill_max_tokens,
        share=(lambda prompts: plan_shared_prefixes(prompts, call.geometry, call.costs, call.sampling.n))
        if share
        else None,
    )


def with_compile_decision(call: RouteCall) -> RouteCall:
    """The call with its compile decision: made once, read by auto's route choice and the CB schedule
    (ordinary `generate` is never compiled)."""
    if call.config.route == "ordinary":
        return call
    shape = cache_shape(call)  # checks an explicit cache_capacity before anything runs
    if call.config.compile is False:  # nothing to weigh (the cost probes' own calls among them)
        return dataclasses.replace(call, compile_decision=choose_compile(False, 0, 0, 0, 0))
    return dataclasses.replace(call, compile_decision=_compile_decision_for(call, shape))


def _compile_decision_for(call: RouteCall, shape: CacheShape) -> CompileDecision:
    longest = max(len(p) for p in call.prompts)
    items = len(call.prompts) * call.sampling.n
    if call.outgrown_window is not None and call.config.compile is not False:
        # The compiled step's attention is not narrowed to the window (the dispatcher's eager path is).
        decision = compile_decision(
            call.model, False, shape.continuous_batch_size, items, longest, call.most_new_tokens, shape.cache_capacity
        )
        return dataclasses.replace(decision, reason="sequences outgrow the model's sliding window: decodes eagerly")
    if call.config.kernels == "invariant" and call.config.compile is not False:
        # The engine's own kernels run eagerly: a graph of the model's own linears would not be invariant.
        decision = compile_decision(
            call.model, False, shape.continuous_batch_size, items, longest, call.most_new_tokens, shape.cache_capacity
        )
        return dataclasses.replace(decision, reason="kernels='invariant' decodes eagerly (compile not used)")
    return compile_decision(
        call.model,
        call.config.compile,
        shape.continuous_batch_size,
        items,
        longest,
        call.most_new_tokens,
        shape.cache_capacity,
        round_capacity=call.config.cache_capacity is None,
        figures=call.compile_figures,
    )


def _record_cache(profile: Profile, runner: ModelRunner) -> None:
    store = runner.store
    if store is not None:
        profile.cache_capacity = store.columns  # rounded up when the decode step is compiled
        profile.kv_cache_bytes = store.nbytes
        profile.trims = store.trims
        profile.trimmed_columns = store.trimmed_columns
        profile.moved_bytes = store.moved_bytes


def cache_shape(call: RouteCall) -> CacheShape:
    items = len(call.prompts) * call.sampling.n
    rows = min(call.sampling.continuous_batch_size, items)
    longest = max(len(p) for p in call.prompts)
    # The largest budget, not each prompt's own: a wide admission moves the shared front for every row, so a
    # short prompt with a long budget can be stretched by a long prompt with a short one.
    budget = call.most_new_tokens
    columns = call.config.cache_capacity
    if columns is None:
        # Enough for any schedule (see StaticKVCache: front - first live column <= longest + budget - 1
        # after trimming), plus one budget of headroom when refills will come, so trims stay rare.
        columns = longest + budget + (budget if items > rows else 0)
    elif columns < longest + budget - 1:
        # A row holds its prompt plus budget - 1 fed-back tokens; trimming keeps every schedule within
        # longest + budget - 1 columns (see StaticKVCache), so this is the exact minimum.
        index = max(range(len(call.prompts)), key=lambda i: len(call.prompts[i]))
        per_prompt = call.sampling.per_prompt_budgets
        budget_text = f"the largest max_new_tokens is {budget}" if per_prompt else f"max_new_tokens={budget}"
        raise ValueError(
            f"cache_capacity={columns} is too small: prompt {index} has {longest} tokens and {budget_text}, which needs {longest + budget - 1} columns; raise cache_capacity to at least "
            f"{longest + budget - 1} (or leave it None to size it per call)"
        )
    return CacheShape(continuous_batch_size=rows, cache_capacity=columns)


def _check_sliding_window(call: RouteCall) -> bool:
    """Whether the call's forwards must narrow attention to the model's sliding window (sequences outgrow
    it): the dispatcher does it on the layers that ask for a window. A model whose attention does not go
    through it (eager attention) is refused."""
    if _window_refusal(call) is not None:
        raise ValueError(
            f"{call.outgrown_window} with attn_implementation={attention_implementation(call.model)!r}: load the "
            "model with attn_implementation='sdpa', or use route='ordinary' (or route='auto', which runs "
            "ordinary generate for such calls)"
        )
    return call.outgrown_window is not None


def _window_refusal(call: RouteCall) -> str | None:
    """Why continuous batching cannot apply the model's sliding window to this call (eager attention)."""
    window_text = call.outgrown_window
    if window_text is None or dispatches(call.model):
        return None
    return f"{window_text}, which continuous batching applies only where attention goes through SDPA"


def _ordinary_instead(call: RouteCall, refusal: str) -> FinishedItems:
    """Auto on a call continuous batching cannot compute (the model's attention backend, or a sequence
    outgrowing its sliding window): ordinary `generate` runs it (neither reading nor filling the prefix
    cache), unless the config rules that out too."""
    blocked = _ordinary_blocked_reason(call.config)
    if blocked is not None:
        raise ValueError(
            f"{refusal}, so only route='ordinary' computes this call, but {blocked}, which ordinary generate "
            "cannot honour: leave cache_capacity None and trim_cache False for this model"
        )
    call.profile.route = ROUTE_ORDINARY
    call.profile.decision_reason = f"{refusal}: ordinary generate runs"
    call.profile.prefill_groups = [[list(range(len(call.prompts)))]]
    return ordinary_route(call)
