"""`Rollout`: the public entry point. One `generate` call =

  resolve the generation config -> validate prompts -> run the configured route -> results in input
  order, with a profile.

Routes are plain functions with one signature, chosen from `routes.ROUTES`; each receives a
`RouteCall` holding everything it needs."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from autobucket.checks import warn_once
from autobucket.config import RolloutConfig, SamplingConfig, sampling_or_default
from autobucket.costs.coefficients import CostCoefficients, ModelGeometry
from autobucket.costs.decode_figures import (
    PROCESS_FIGURES,
    CompileFigures,
    DecodeFigures,
    figures_key,
    probe_eager_steps,
)
from autobucket.costs.source import CostSource, RunRoute
from autobucket.engine.batching.prefix_cache import PrefixCache
from autobucket.engine.finished import StopStrings
from autobucket.engine.generation_setup import ResolvedSampling, resolve_generation
from autobucket.engine.intercept.attention import checkpointing_layers_kept_cached, eval_semantics
from autobucket.engine.intercept.functions import has_conv1d
from autobucket.engine.intercept.grad_mode import autograd_off_for
from autobucket.engine.intercept.kernel_sets import (
    check_call_settings,
    check_invariant_model,
    check_kernel_device,
    runs_triton_set,
)
from autobucket.engine.kernel_choice import KernelChoice, resolve_kernels
from autobucket.engine.kernels.onednn_probes import warn_if_slow_bf16_gemm
from autobucket.engine.kernels.packed_linear import PackedLinears
from autobucket.engine.model_access.hf_compat import (
    ForwardSpec,
    attention_backend,
    check_weights_loaded,
    continuous_batching_refusal,
    forward_spec,
    sliding_window_limit,
    unwrap_model,
    vocab_size,
)
from autobucket.engine.model_access.lockstep import lockstep_forwards
from autobucket.engine.model_access.rank_failures import distributed_ready, failures_shared
from autobucket.engine.model_access.sharded_weights import (
    gathered_weights,
    gathering_communicates,
    is_sharded,
    sharded_forwards,
    zero3_partitioned,
)
from autobucket.engine.model_access.weight_versions import merged_adapters, weights_version
from autobucket.engine.plan.forward_plan import ForwardPlan, check_op_backends, choose_plan, plan_entered
from autobucket.engine.request import Request
from autobucket.engine.routes import PLANNING_ROUTES, ROUTES, RouteCall, with_compile_decision
from autobucket.profile import PeakMemory, PhaseTimer, Profile
from autobucket.prompts import check_context, check_tokenizer, normalize_prompts, unpad_left_padded
from autobucket.result import RolloutResult
from autobucket.threads import warn_if_oversubscribed


class Rollout:
    """Batched, token-exact generation on a Hugging Face causal LM.

    >>> rollout = Rollout(model, tokenizer, RolloutConfig(route="auto"))
    >>> result = rollout.generate(prompts, SamplingConfig(max_new_tokens=16))

    Calls on one `Rollout` run one at a time: a call from another thread waits for the one in flight
    (they share the prefix cache, the learned costs and the stop-string matcher). Threads that should
    generate in parallel each take their own `Rollout` of the model (with its own packed copies, under
    `kernels="invariant"`).
    """

    def __init__(self, model: Any, tokenizer: Any = None, config: RolloutConfig | None = None) -> None:
        self.model = unwrap_model(model)
        # what a call gathers when sharded: the wrapper as handed over (FSDP's root may sit above the
        # unwrapped model, a PeftModel's say, holding the embeddings' shards)
        self._wrapper = model
        check_weights_loaded(self.model)
        check_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.config = config if config is not None else RolloutConfig()
        if not isinstance(self.config, RolloutConfig):
            raise TypeError(f"config must be a RolloutConfig, got {type(self.config).__name__}")
        self.spec: ForwardSpec = forward_spec(self.model)
        check_op_backends(self.config.op_backends or {})
        parameter = next(self.model.parameters())
        if self.config.kernels == "invariant":
            check_kernel_device(parameter.device)
        self.geometry = ModelGeometry.from_config(self.model.config, parameter.dtype)
        self.max_positions = self.geometry.max_positions
        # the kernel set the forwards run ("auto" resolved), chosen again at each call (`_follow_model`)
        self.kernel_choice: KernelChoice = resolve_kernels(self.model, self.config)
        self.cost_source = CostSource(self._call_config(), self.model, self.geometry, sliding_window_limit(self.model.config))
        self._fingerprint = self._model_fingerprint()  # what the costs were learned for (`_follow_model`)
        self.packed_linears = _packed_linears_for(self.model, self._call_config())
        self._conv1d = has_conv1d(self.model)  # GPT-2's Conv1D addmm calls need routing too
        self.prefix_cache = PrefixCache(int(self.config.prefix_cache_mb * 2**20)) if self.config.prefix_cache_mb else None
        self._stops: StopStrings | None = None  # the last call's stop strings, matched with the tokenizer
        self._stops_vocabulary: int | None = None  # len(tokenizer) when that matcher was built
        # one call at a time (re-entrant: `generate` reads `costs`, which may probe through `_run_route`)
        self._call_lock = threading.RLock()
        self.decode_figures: DecodeFigures = PROCESS_FIGURES  # measured step and graph figures (`compile="auto"`)
        warn_if_oversubscribed()  # more threads than cores slows every step (autobucket.threads)
        warn_if_slow_bf16_gemm(parameter.dtype, self.kernel_choice.kernels, parameter.device.type)  # torch's bf16 GEMM is slow on AVX2-only CPUs

    @property
    def vocab_size(self) -> int:
        """The ids the model can emit now: read at each call, since a trainer may resize the embeddings
        (`resize_token_embeddings` after adding tokens) between calls."""
        return vocab_size(self.model)

    @property
    def costs(self) -> CostCoefficients:
        """The coefficients the next call plans with (online: probed now if nothing was learned yet). On a
        sharded model the probe runs on the gathered weights: every rank reads it together."""
        with self._call_lock, self._sharded_call():
            self._follow_model()
            return self.cost_source.current(self._probe_runner())

    def _model_fingerprint(self) -> tuple:
        """What the cost model's timings depend on that a trainer can change between calls (a few
        attribute reads; the full entry metadata is built only when this changed)."""
        parameter = next(self.model.parameters())
        return (parameter.dtype, parameter.device, attention_backend(self.model), torch.get_num_threads())

    def _follow_model(self) -> None:
        """After `model.to(torch.bfloat16)` (or a new device, thread count, attention) the planner's KV
        bytes and the learned costs are those of the model as it is now, not as it was handed over."""
        fingerprint = self._model_fingerprint()
        if self.config.kernels == "invariant":
            check_kernel_device(fingerprint[1])
        choice = resolve_kernels(self.model, self.config)  # "auto" may change its answer with the model
        if (fingerprint, choice) == (self._fingerprint, self.kernel_choice):
            return
        geometry = ModelGeometry.from_config(self.model.config, fingerprint[0])
        self.cost_source.config = self._call_config(choice)  # costs are keyed by the set that runs
        try:
            self.cost_source.follow(geometry)  # may refuse a calibration file: then nothing here changed
        except BaseException:
            self.cost_source.config = self._call_config()
            raise
        self._fingerprint, self.geometry, self.kernel_choice = fingerprint, geometry, choice
        warn_if_slow_bf16_gemm(fingerprint[0], choice.kernels, fingerprint[1].type)

    def _call_config(self, choice: KernelChoice | None = None) -> RolloutConfig:
        """The config the engine runs: `kernels` is the set `resolve_kernels` chose (`choice`, else this
        Rollout's current one), so no route, cache key or cost entry ever reads "auto"."""
        kernels = (choice or self.kernel_choice).kernels
        return self.config if self.config.kernels == kernels else dataclasses.replace(self.config, kernels=kernels)

    def refresh_weights(self) -> None:
        """Repack before the next forward: for weight writes that bypass version counters (`param.data`
        copies); optimizer steps, `copy_` under `no_grad` and `load_state_dict` are seen without it."""
        with self._call_lock:  # after the call in flight, whose forwards read the packs
            if self.packed_linears is not None:
                self.packed_linears.refresh()
            if self.prefix_cache is not None:
                self.prefix_cache.invalidate()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self, prompts: Sequence[Any], sampling: SamplingConfig | None = None, **overrides: Any
    ) -> RolloutResult:
        """Generate for every prompt; `overrides` are GenerationConfig fields (validated)."""
        with self._call_lock:
            return self._generate(prompts, sampling, overrides)

    def _generate(self, prompts: Sequence[Any], sampling: SamplingConfig | None, overrides: dict) -> RolloutResult:
        started = time.perf_counter()
        # a refusal on one rank stops every rank, when the gathering (or the pairing) below would communicate
        communicates = gathering_communicates(self._wrapper) or self._pairs_zero3()
        with failures_shared(communicates and distributed_ready()):
            sampling = sampling_or_default(sampling)
            generation = resolve_generation(self.model, sampling, overrides, self.vocab_size)
            stops = self._stop_strings(generation.stop_strings)
            self._follow_model()
            _warn_if_autocast_forward(self.model, self._call_config())
            token_prompts = normalize_prompts(prompts, self.tokenizer, self.vocab_size)
            check_context(token_prompts, sampling.request_budgets(len(token_prompts)), self.max_positions)
        with self._sharded_call():  # every rank of a sharded model, even one with no prompts, joins in
            if not token_prompts:
                profile = self._profile(self.config.route)
                return RolloutResult([], [], self.config.route, profile, [] if sampling.logprobs else None)
            return self._generate_checked(token_prompts, sampling, generation, stops, started)

    def _generate_checked(
        self, token_prompts: list[list[int]], sampling: SamplingConfig, generation: ResolvedSampling,
        stops: StopStrings | None, started: float,
    ) -> RolloutResult:
        # Only the planning routes need coefficients: the others never trigger the online probe, nor do
        # models continuous batching cannot run (auto runs ordinary generate for them, bucketed refuses).
        # the model was followed above: the cost source directly, not `self.costs` (which follows again)
        plans = self.config.route in PLANNING_ROUTES and continuous_batching_refusal(self.model) is None
        costs = self.cost_source.current(self._probe_runner() if plans else None)
        prefix_cache, cleared = self._prefix_cache()
        result = self._run_route(
            self._call_config(), token_prompts, sampling, generation, costs, started, prefix_cache, stops
        )
        result.profile.prefix_cache_invalidations = int(cleared)
        self.cost_source.after_call(result.profile, costs)
        return result

    @contextmanager
    def _sharded_call(self) -> Iterator[None]:
        """A sharded model's weights for the call (`sharded_weights`), on every rank: "gathered", the full
        weights once per call; "lockstep", the forwards paired across ranks on the shards (one-token
        forwards after this rank's work, until every rank's is done). The shards are written without
        bumping their version counters, so what was derived from the weights (packed copies, prefix-cache
        K/V) is rebuilt every call."""
        if self._pairs_zero3():  # ZeRO-3's hooks gather and release each submodule's parameters
            with self._lockstep(distributed_ready()):
                self.refresh_weights()
                yield
            return
        if not is_sharded(self._wrapper):
            yield
            return
        if self.config.sharded_weights == "gathered":
            with gathered_weights(self._wrapper):
                self.refresh_weights()
                yield
            return
        # nested in a caller's gather (every group unsharded) the forwards communicate nothing to pair
        paired = gathering_communicates(self._wrapper) and distributed_ready()
        with sharded_forwards(self._wrapper, self.model), self._lockstep(paired):
            self.refresh_weights()
            yield

    def _pairs_zero3(self) -> bool:
        """A ZeRO-3 module handed over directly under lockstep (gathered, it is the DeepSpeed adapter's
        engine that gathers: `integrations/zero3_weights.py`)."""
        return self.config.sharded_weights == "lockstep" and zero3_partitioned(self._wrapper)

    @contextmanager
    def _lockstep(self, paired: bool) -> Iterator[None]:
        if not paired:
            yield
            return
        with lockstep_forwards(self.model, self._one_token_forward):
            yield

    def _one_token_forward(self) -> None:
        """A forward whose output is discarded, run to pair its collectives with a peer rank's forward:
        without dropout (the trainer's random stream untouched), without autograd."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with autograd_off_for(self.model), eval_semantics(self.model):
            self.model(input_ids=ids, use_cache=False)

    def _run_route(
        self,
        config: RolloutConfig,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        generation: ResolvedSampling,
        costs: CostCoefficients | None,
        started: float,
        prefix_cache: PrefixCache | None = None,
        stops: StopStrings | None = None,
    ) -> RolloutResult:
        """One route on validated prompts: the engine-level runner both `generate` and the cost probe use
        (the probe without the prefix cache: its prompts are not the user's)."""
        profile = self._profile(config.route)
        # Online learning needs true phase times, so it synchronises a CUDA device at phase boundaries.
        timer = PhaseTimer(profile, self.device, synchronize=config.profile or self.cost_source.online)
        call = RouteCall(
            self.model,
            self.spec,
            self.geometry,
            costs or CostCoefficients(),
            config,
            prompts,
            generation.for_prompts(sampling, len(prompts)),
            profile,
            timer,
            self.vocab_size,
            self.max_positions,
            prefix_cache=prefix_cache,
            stops=stops,
            compile_figures=self._compile_figures(config),
        )
        call = with_compile_decision(call)
        plan = choose_plan(self.model, config, call.compile_decision, config.route)
        profile.plan = plan.summary()
        with PeakMemory(self.device) as memory, self.forward_scope(profile, plan):
            finished = ROUTES[config.route](call)
        return _result(call, finished, memory, started)

    def _compile_figures(self, config: RolloutConfig) -> CompileFigures | None:
        """The decode figures a call's compile decision reads and its steps feed: `decode_figures` at the
        model's key for the call's kernel set, the eager step probed through the engine's own routes; None
        where nothing is weighed (compile=False, the default and the probes' own calls; ordinary generate)."""
        if config.compile is False or config.route == "ordinary":
            return None
        runner = self._probe_runner()
        key = figures_key(self.model, config.kernels)
        return CompileFigures(self.decode_figures, key, lambda rows: probe_eager_steps(runner, rows, self.vocab_size))

    def _profile(self, route: str) -> Profile:
        kernels, reason = self.kernel_choice
        return Profile(route=route, kernels=kernels, kernels_reason=reason)

    @contextmanager
    def forward_scope(self, profile: Profile, plan: ForwardPlan | None = None) -> Iterator[None]:
        """What every engine forward on this thread runs under: the model's own dtype, autograd off, eval
        semantics (no dropout) for a model handed over in train() mode without flipping its flag, the KV
        cache kept under gradient checkpointing, and the call's plan (None: this Rollout's config's plan).
        Other threads' forwards are untouched."""
        plan = plan if plan is not None else choose_plan(self.model, self._call_config())
        with (
            without_autocast(self.device),
            autograd_off_for(self.model),
            eval_semantics(self.model),
            checkpointing_layers_kept_cached(self.model),
            self._kernels(profile, plan),
        ):
            yield

    @contextmanager
    def _kernels(self, profile: Profile, plan: ForwardPlan) -> Iterator[None]:
        """`plan` entered for this call's forwards, with what packing cost (the C++ kernel set's packed
        weights; the Triton set packs nothing)."""
        if plan.kernel_set == "torch":
            with plan_entered(plan, self.model, None):
                yield
            return
        check_call_settings(self.model)
        if plan.kernel_set == "triton":
            with plan_entered(plan, self.model, None, conv1d=self._conv1d):
                yield
            return
        if self.packed_linears is None:  # made on a CUDA device, or the plan differs from construction's
            # (the cost probe decodes eagerly: "auto" without compile=True takes the engine's set)
            self.packed_linears = _packed_linears_for(self.model, dataclasses.replace(self.config, kernels="invariant"))
        packs = self.packed_linears
        packs.follow_merges(merged_adapters(self.model))
        made, pack_ms = packs.packs_made, packs.pack_ms
        try:
            with plan_entered(plan, self.model, packs, conv1d=self._conv1d):
                yield
        finally:
            profile.packs_made += packs.packs_made - made
            profile.pack_ms += packs.pack_ms - pack_ms
            profile.packed_weight_bytes = packs.nbytes

    def _stop_strings(self, strings: tuple[str, ...]) -> StopStrings | None:
        """The matcher for this call's stop strings (kept while the strings and the tokenizer's size stay the
        same: building one reads the tokenizer's whole vocabulary)."""
        if not strings:
            return None
        if self.tokenizer is None:
            raise ValueError(
                f"stop_strings={list(strings)!r} need the model's tokenizer to match text: create the Rollout "
                "with it, Rollout(model, tokenizer, config), or pass stop_strings=[] to generate without them"
            )
        # tokens added since (`add_tokens`) need a new matcher
        vocabulary = len(self.tokenizer) if hasattr(type(self.tokenizer), "__len__") else None
        if self._stops is None or (self._stops.strings, self._stops_vocabulary) != (strings, vocabulary):
            self._stops, self._stops_vocabulary = StopStrings(self.tokenizer, strings), vocabulary
        return self._stops

    def _prefix_cache(self) -> tuple[PrefixCache | None, bool]:
        """The prefix cache at the weights' current version, and whether entries of other weights were cleared."""
        cache = self.prefix_cache
        if cache is None:
            return None, False
        version = weights_version(self.model, attention_backend(self.model), self.kernel_choice.kernels)
        return cache, cache.use_version(version)

    def _probe_runner(self) -> RunRoute:
        """The online probe's calls: the engine's routes under this Rollout's own config (token budget,
        packing, trimming), with the route given, the cache sized per call, fixed coefficients (so a probe never probes), eager decode
        (compile time is not a cost term), learning nothing itself."""

        def run(route: str, prompts: list[list[int]], sampling: SamplingConfig) -> Profile:
            config = dataclasses.replace(
                self._call_config(), route=route, costs=CostCoefficients(), compile=False, cache_capacity=None
            )  # the probe sizes its own calls
            generation = resolve_generation(self.model, sampling, {}, self.vocab_size)
            check_context(prompts, sampling.request_budgets(len(prompts)), self.max_positions)
            return self._run_route(config, prompts, sampling, generation, None, time.perf_counter()).profile

        return run

    def generate_padded(
        self,
        input_ids: torch.Tensor | np.ndarray,
        attention_mask: torch.Tensor | np.ndarray,
        sampling: SamplingConfig | None = None,
        **overrides: Any,
    ) -> RolloutResult:
        """The RL-trainer layout: left-padded `[batch, width]` ids and mask (tensors or numpy arrays)."""
        return self.generate(unpad_left_padded(input_ids, attention_mask), sampling, **overrides)


def _warn_if_autocast_forward(model: torch.nn.Module, config: RolloutConfig) -> None:
    """accelerate's mixed precision (`Accelerator(mixed_precision="bf16")`, TRL's `bf16=True` on an fp32
    model) wraps `model.forward` in autocast: the ordinary route (HF `generate`, through that forward)
    follows it; the continuous-batching routes with the default kernels follow it in prefill (bitwise the
    prepared forward's logits) but their decode steps attend on the engine's kernel in the model's dtype,
    where the forward's SDPA computes in bf16, so their tokens can differ from it (measured: as often as a
    bf16 model's default-kernel routes differ from its own generate). Named once per process."""
    engine_decode = config.kernels == "auto" or (config.op_backends or {}).get("decode_attention") == "cpu"
    if not engine_decode or config.route == "ordinary":
        return
    if "forward" in vars(model) and hasattr(model, "_original_forward"):  # accelerate's wrapped forward
        warn_once(
            f"autobucket: {type(model).__name__}.forward runs under accelerate's mixed precision (autocast); "
            f"route={config.route!r} with the engine's decode attention (kernels='auto' on a model the invariant set cannot run, or op_backends={{'decode_attention': 'cpu'}}) runs it in the model's dtype where that "
            "forward computes it in bf16, so its tokens can differ from that forward's generate. Use "
            "kernels='invariant' (the model's dtype on every route, bitwise autobucket.invariant's trainer "
            "forward), route='ordinary', or a model loaded in bfloat16",
            RuntimeWarning,
            stacklevel=5,  # warn_once, this, _generate, generate: the caller's line
        )


def without_autocast(device: torch.device) -> torch.autocast:
    """The call computes in the model's own dtype: an autocast region it was made in (a trainer's mixed-
    precision step) would reach some of a route's ops (the model's linears) and not others (the engine's
    cache and kernels), so routes would disagree with each other and with single-request `generate`."""
    return torch.autocast(device.type, enabled=False)


def _packed_linears_for(model: torch.nn.Module, config: RolloutConfig) -> PackedLinears | None:
    if config.kernels != "invariant":
        return None
    check_invariant_model(model)
    if runs_triton_set(next(model.parameters()).device):  # the Triton set reads the weights in place
        return None
    if config.sharded_weights == "lockstep" and (is_sharded(model) or zero3_partitioned(model)):
        # no copies: a copy of every layer is what lockstep avoids; each GEMM reads its layer's weight as
        # FSDP all-gathered it for the forward (bitwise a packed copy's values, as the trainer's scope)
        return PackedLinears(budget_bytes=0)
    budget = None if config.packed_weights_mb is None else int(config.packed_weights_mb * 2**20)
    return PackedLinears(budget, fuse=True)


def _nest(values: list, samples_per_prompt: int) -> list:
    """Per-item values -> per prompt (n == 1) or per prompt a list of n (n > 1)."""
    if samples_per_prompt == 1:
        return values
    return [values[start : start + samples_per_prompt] for start in range(0, len(values), samples_per_prompt)]


def _result(
    call: RouteCall, finished: dict[tuple[int, int], Request], memory: PeakMemory, started: float
) -> RolloutResult:
    profile, n = call.profile, call.sampling.n
    ordered = [finished[(p, s)] for p in range(len(call.prompts)) for s in range(n)]
    tokens = [item.tokens for item in ordered]
    profile.output_tokens = sum(len(t) for t in tokens)
    profile.peak_memory_bytes = memory.peak_bytes()
    profile.peak_memory_growth_bytes = memory.growth_bytes
    if call.timer.device.type == "cuda":
        torch.cuda.synchronize(call.timer.device)
    profile.total_ms = (time.perf_counter() - started) * 1e3
    profile.tokens_per_s = profile.output_tokens / max(profile.total_ms / 1e3, 1e-9)
    logprobs = _nest([item.logprobs for item in ordered], n) if call.sampling.selection.want_logprobs else None
    return RolloutResult(
        _nest(tokens, n), _nest([item.finish_reason for item in ordered], n), profile.route, profile, logprobs
    )
