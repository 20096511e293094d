"""User-facing configuration: how a `Rollout` runs (`RolloutConfig`) and what one call generates
(`SamplingConfig`). Both are frozen and validated on construction, so a bad value fails before any
model work starts and names the field, the value and the fix."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, TypeAlias, get_args

from autobucket.checks import (
    optional_int,
    plain_int_or_list,
    require_bool,
    require_choice,
    require_finite,
    require_int,
)

if TYPE_CHECKING:
    from autobucket.costs.coefficients import CostCoefficients

# The public value types, visible to a type checker (`RolloutConfig(route="fastest")` fails the check).
Route: TypeAlias = Literal["ordinary", "equal_width", "aligned", "bucketed", "auto"]
CompileChoice: TypeAlias = bool | Literal["auto"]
Kernels: TypeAlias = Literal["auto", "invariant", "torch", "hf"]  # "hf": the deprecated spelling of "torch"
LogprobsMode: TypeAlias = Literal["trainer", "processed"]
ShardedWeights: TypeAlias = Literal["gathered", "lockstep"]
# A path to a calibration / coefficients JSON, "online", None (learn online) or the coefficients themselves.
CostsSpec: TypeAlias = "CostCoefficients | str | os.PathLike[str] | None"

ROUTES: tuple[Route, ...] = get_args(Route)
COMPILE_CHOICES: tuple[CompileChoice, ...] = ("auto", True, False)
KERNELS: tuple[Kernels, ...] = get_args(Kernels)
DEPRECATED_KERNELS = {"hf": "torch"}  # old spelling -> the value it now means
LOGPROBS_MODES: tuple[LogprobsMode, ...] = get_args(LogprobsMode)
SHARDED_WEIGHTS: tuple[ShardedWeights, ...] = get_args(ShardedWeights)


@dataclass(frozen=True)
class RolloutConfig:
    """How the engine runs.

    route: "ordinary" (HF generate on the left-padded batch), "equal_width" (CB, each admission
      prefilled as one padded batch), "aligned" (CB, one prefill per request), "bucketed" (CB, each
      admission split into the planner's DP buckets) or "auto" (the cost model picks "ordinary" or
      "bucketed" per call; the default).
    costs: the cost model's coefficients (used by "auto" and "bucketed"): None or "online" (learned from
      every call, starting from what earlier processes learned for this model on this machine, else from a
      probe of a few seconds), a `CostCoefficients`, or a path to a calibration / coefficients JSON.
    costs_strict: a calibration file whose model, dtype, device or attention backend differs from this
      model's is an error (False: a warning).
    prefill_max_tokens: token budget of one prefill forward (padding included; None: no limit). A prompt
      longer than it is prefilled in chunks of at most this many tokens.
    packing: let "bucketed" and "auto" pack several prompts into one unpadded forward when the cost
      model prefers it (False: padded buckets only).
    cache_capacity: KV columns of the static cache (None: what the workload needs).
    trim_cache: trim dead left columns after every admission and retirement (else only when full).
    profile: add device-synchronised timing detail to the profile.
    compile: compile the continuous-batching decode step with `torch.compile` over static shapes.
      False (default): never — the bit-for-bit eager path; True: always (seconds to a minute per new
      decode shape; graphs are kept per model and reused by later calls); "auto": reuse graphs already
      compiled, and compile new ones only when the call's predicted decode saving repays the compile
      time (`planning.compile_choice`). Compiled logits differ from eager ones in the last bits, which
      can flip a near-tied greedy token (docs/routes.md), hence the default. A model that cannot be compiled
      decodes eagerly with a warning; the reason is in `Profile.compile_fallback`.
    cuda_graphs: replay the continuous-batching decode step from CUDA graphs, one per (row bucket, column
      bucket) of the static cache, captured at the first step of each (milliseconds; the weights are read
      where they are, so optimizer steps are seen; graphs are dropped when hooks, adapters, dtype, device or
      the kernel set change). "auto" (default): where it can — a CUDA model whose decode runs the engine's
      Llama-family step and no compiled step (`Profile.plan["decode_step"] == "captured"`, else the reason);
      True: require it (a call that cannot is a ValueError naming why, before any work); False: never.
      Tokens and logprobs are bitwise those of the eager step on the same kernels.
    persist_costs: keep what online learning learns between processes (the only switch for it). True
      (default): start from the entry in `$AUTOBUCKET_CACHE_DIR/online-costs` (default root
      `~/.cache/autobucket`) for this model, kernels and CPU kind, and save it after every call. Only
      one process writes: rank 0 of `torch.distributed` when it is initialised, else the process whose
      `RANK` environment variable (set by torchrun, accelerate and deepspeed launchers) is 0 or unset;
      the other ranks read. A cache folder that cannot be written gets one warning and the call goes
      on. False: the cache folder is neither read nor written; learning stays in this process.
    kernels: which kernels the forwards run; `Profile.plan` names the backend of every op family and why.
      "auto" (default): the engine's own kernels (as "invariant") wherever they can run the model, and
      elsewhere the model's own linears and attention with the engine's elementwise and decode kernels
      where those run: on a CUDA device, for a dtype other than float32 / bfloat16, for attention that
      does not go through transformers' "sdpa" interface (eager attention, a class calling torch's SDPA
      itself), without oneDNN or strict fp32 matmuls, where the C++ kernel library does not build, and
      with `compile=True` (the compiled step runs the model's own ops). Never refused:
      `Profile.kernels` and `Profile.kernels_reason` say which set ran and why. Its tokens come from the
      set that ran: equal to `kernels="invariant"`'s where the engine's kernels run (so not always
      bitwise HF `generate`'s). "invariant": require the engine's own kernels (`engine/kernels/`), refused
      where they cannot run: every linear on oneDNN-prepacked weights that follow in-place weight updates
      (`Rollout.refresh_weights()` for writes through `.data`) and every attention call on a kernel whose
      reduction order depends only on the sequence, so a token's logits are bitwise the same on every
      route, batch, padding, refill order and n, and equal a trainer's forward under
      `autobucket.invariant(model)`. fp32 stays strict fp32; bf16 linears run oneDNN's bf16 GEMM in fixed
      32-row blocks (it picks its kernel by the row count, so one GEMM over all rows is not invariant), or
      fp32 GEMMs on an fp32 copy where the CPU has no bf16 GEMM; one more copy of the linear weights is
      held (`packed_weights_mb` bounds it); the compiled step is not used; needs SDPA attention (not
      eager) and a C++ compiler at first use. "torch": the model's own ops everywhere (its linears,
      transformers' SDPA, its elementwise code); "hf" is its deprecated spelling (a DeprecationWarning,
      stored as "torch").
    op_backends: op family -> backend name, for the ops a call may give to another backend than the
      kernel set's ("rotary", "gated_mlp", "rms_norm", "decode_attention"): a built-in backend ("cpu":
      the engine's C++ kernels, "torch") or one registered with `autobucket.engine.plan.register_backend`.
      Checked when the Rollout is made (an unknown op or backend is a ValueError naming the choices).
    packed_weights_mb: where the engine's kernels run ("invariant", or "auto" where it takes them), the most
      memory their packed copies of the linear weights may hold (None, the default: every linear packed,
      one more copy of those weights). Linears past the budget read the live weight, bitwise the same
      values, more slowly: fp32 ones on the fixed-order kernel's unpacked form, bf16 ones on oneDNN
      reordering per call (0: no copies at all; docs/benchmarks.md has the memory and time each costs).
    prefix_cache_mb: memory for a prefix KV cache across calls (0, the default: off). Every finished
      sequence (prompt + generated tokens) is kept, least recently used evicted first, so a next call
      whose prompt extends one (the next turn of a conversation, a shared system prompt) prefills only
      its new tokens, attending to the cached K/V (`Profile.cached_prompt_tokens`). Keyed by the
      tokens and the weights' version: an optimizer step, `load_state_dict` or
      `Rollout.refresh_weights()` empties it, so K/V of old weights is never served. Continuous-batching
      routes only (auto chooses them when a prompt hits). Off by default because it holds memory in the
      trainer's process between calls, and most RL calls follow a weight update that empties it.
    share_prefixes: let "bucketed" and "auto" prefill a prefix that several prompts of one admission
      share (a system prompt, a few-shot header; at least 32 tokens) once and continue each prompt from
      it, when the cost model says it pays (`planning/shared_prefix.py`; `Profile.shared_prefixes`).
    sharded_weights: for a model sharded over ranks (FSDP2), how a call reaches its weights. "gathered"
      (the default): the full weights all-gathered once per call, each rank then generating alone.
      "lockstep": each rank keeps its shards and runs the sharded forward, every forward paired across
      ranks (a rank done early runs one-token forwards until all are done); for models too large to
      gather, at one small all-reduce plus the layers' all-gathers per forward (docs/sharded-trainers.md).
    """

    route: Route = "auto"
    costs: CostsSpec = None
    costs_strict: bool = True
    prefill_max_tokens: int | None = 65536
    packing: bool = True
    cache_capacity: int | None = None
    trim_cache: bool = False
    profile: bool = False
    compile: CompileChoice = False
    cuda_graphs: CompileChoice = "auto"
    persist_costs: bool = True
    kernels: Kernels = "auto"
    prefix_cache_mb: float = 0.0
    share_prefixes: bool = True
    packed_weights_mb: float | None = None
    sharded_weights: ShardedWeights = "gathered"
    op_backends: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        require_choice("compile", self.compile, COMPILE_CHOICES)
        require_choice("cuda_graphs", self.cuda_graphs, COMPILE_CHOICES)
        if self.cuda_graphs is True and self.compile is True:
            raise ValueError(
                "RolloutConfig(cuda_graphs=True, compile=True): cuda_graphs captures the engine's eager decode "
                "step, compile=True compiles it instead; set one of them (compile=False, or cuda_graphs='auto')"
            )
        require_choice("sharded_weights", self.sharded_weights, SHARDED_WEIGHTS)
        if self.sharded_weights == "lockstep" and self.compile is not False:
            raise ValueError(
                f"sharded_weights='lockstep' with compile={self.compile!r} is refused: lockstep pairs each forward "
                "across ranks from a hook on the model's forward, and FSDP's own hooks all-gather inside it, "
                "which a compiled decode forward would trace; pass compile=False (lockstep forwards run eagerly)"
            )
        require_choice("kernels", self.kernels, KERNELS)
        if self.kernels in DEPRECATED_KERNELS:
            instead = DEPRECATED_KERNELS[self.kernels]
            warnings.warn(
                f"RolloutConfig(kernels={self.kernels!r}) is deprecated: it means kernels={instead!r} (the model's "
                f"own ops); pass kernels={instead!r}",
                DeprecationWarning,
                stacklevel=3,
            )
            _store(self, "kernels", instead)
        _store(self, "op_backends", _op_backends(self.op_backends))
        if self.route not in ROUTES:
            raise ValueError(f"route={self.route!r} is invalid: choose one of {', '.join(ROUTES)}")
        # Numbers are stored as the plain Python values their checks return (numpy's are accepted).
        fix = "or pass None for no limit"
        _store(self, "prefill_max_tokens", optional_int("prefill_max_tokens", self.prefill_max_tokens, 1, fix))
        fix = "or pass None to size it per call"
        _store(self, "cache_capacity", optional_int("cache_capacity", self.cache_capacity, 1, fix))
        fix = "pass megabytes >= 0 (0 turns the prefix cache off)"
        _store(self, "prefix_cache_mb", require_finite("prefix_cache_mb", self.prefix_cache_mb, fix, minimum=0.0))
        if self.packed_weights_mb is not None:
            fix = "pass megabytes >= 0, or None for no limit"
            budget_mb = require_finite("packed_weights_mb", self.packed_weights_mb, fix, minimum=0.0)
            _store(self, "packed_weights_mb", budget_mb)
        for name in ("trim_cache", "profile", "costs_strict", "packing", "persist_costs", "share_prefixes"):
            require_bool(name, getattr(self, name))
        if self.costs is not None and not isinstance(self.costs, (str, os.PathLike)):
            from autobucket.costs.coefficients import CostCoefficients

            if not isinstance(self.costs, CostCoefficients):
                raise ValueError(
                    f"costs={self.costs!r} is invalid: pass a CostCoefficients, a path to a costs JSON, or "
                    "None / 'online' to learn them"
                )


# Each warper's valid range (transformers' MinP/Typical/Epsilon/Eta LogitsWarper ranges, the "off" value
# included) and the value that disables it.
_WARPER_RANGES = {
    "min_p": (lambda v: 0.0 <= v <= 1.0, "[0, 1]", 0.0),
    "typical_p": (lambda v: 0.0 < v <= 1.0, "(0, 1]", 1.0),
    "epsilon_cutoff": (lambda v: 0.0 <= v < 1.0, "[0, 1)", 0.0),
    "eta_cutoff": (lambda v: 0.0 <= v < 1.0, "[0, 1)", 0.0),
}


# Each option that only acts when sampling, and its "off" value (what greedy decoding accepts).
_SAMPLING_ONLY = {"top_k": 0, "top_p": 1.0, **{name: off for name, (_, _, off) in _WARPER_RANGES.items()}}


@dataclass(frozen=True)
class SamplingConfig:
    """What one `generate` call produces: the one owner of every sampling option.

    `Rollout.generate` reads sampling only from here: the model's `generation_config` sampling values
    (do_sample, temperature, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff,
    repetition_penalty) are not used, and passing any of them as a `generate` override is a ValueError.
    The TRL and DeepSpeed adapters translate their trainer's generation settings into these fields.

    max_new_tokens: generation budget per request (the first token comes from prefill): one int for every
      prompt, or one int per prompt (agent turns with different context budgets left, say); a prompt's
      budget covers each of its n samples, and a request's tokens do not depend on the others' budgets.
    continuous_batch_size: most rows decoded at once; more rows wait in a queue and refill.
    repetition_penalty: HF's penalty over the prompt and generated tokens (1.0: off). This value is
      used as given; the model's generation_config value is not consulted.
    eos_token_id: int or list of ints; None uses the model's resolved generation config; [] disables
      EOS (every row generates its full budget).
    temperature: 0.0 is greedy; > 0 samples (the warpers below apply only then, as in HF, and in HF's
      order: temperature, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff). Greedy with a
      warper set, or with n > 1, is a ValueError rather than silently the greedy answer (HF refuses greedy
      n > 1 too): set temperature > 0 to sample; `greedy_copies` opts in to n identical greedy samples.
    top_k: keep the k most likely tokens (0: off). top_p: nucleus mass to keep (1.0: off).
    min_p: drop tokens less likely than min_p x the most likely one's probability, in [0, 1] (0.0: off).
    typical_p: locally typical sampling's mass to keep, in (0, 1] (1.0: off).
    epsilon_cutoff: drop tokens with probability below it, in [0, 1) (0.0: off).
    eta_cutoff: eta sampling, drop tokens below min(eta, sqrt(eta) * exp(-entropy)), in [0, 1) (0.0: off).
    seed: int for the whole call (each prompt's stream is keyed by (seed, prompt index)), or one int
      per prompt (streams then do not depend on the prompt's position in the batch). Unused when greedy,
      and accepted then: trainers set one seed for the run whatever the temperature.
    n: samples per prompt; each unique prompt is prefilled once and its KV shared by its n rows.
    greedy_copies: allow n > 1 with temperature 0.0, giving n identical greedy samples per prompt (what
      a trainer that asks for repeated greedy prompts gets, and an exactness check of shared decoding);
      no effect when sampling.
    logprobs: also return each generated token's log-probability.
    logprobs_mode: which log-probability. "trainer" (default): what an RL trainer computes for the token,
      `log_softmax(logits / temperature)` over the full vocabulary from the model's raw logits in the
      model's dtype (TRL's `selective_log_softmax`; `autobucket.trainer_logprobs`), temperature 1 when
      greedy, no penalty or top-k / top-p; with `RolloutConfig(kernels="invariant")` and the trainer's
      forward under `autobucket.invariant(model)` they are bitwise the trainer's. "processed": under the
      distribution actually sampled from (after the penalty and every warper), in fp32.
    min_new_tokens: EOS cannot be chosen before a request has this many new tokens (HF's
      `MinNewTokensLengthLogitsProcessor`: its EOS logits are -inf until then; stop strings and the budget
      still end it). None uses the model's generation config (usually none); 0 turns it off.
    stop_strings: a string or list of strings that end a request as HF `generate(stop_strings=...)` does:
      once a generated token completes one (the string may begin in the prompt's last tokens; the token
      may run past its end), with that token kept and the finish reason "stop". Needs the Rollout's
      tokenizer. None uses the model's generation config (usually none); [] disables them.
    """

    max_new_tokens: int | list[int] = 16
    continuous_batch_size: int = 32
    repetition_penalty: float = 1.0
    eos_token_id: int | list[int] | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    seed: int | list[int] = 0
    n: int = 1
    logprobs: bool = False
    logprobs_mode: LogprobsMode = "trainer"
    stop_strings: str | list[str] | None = None
    min_new_tokens: int | None = None
    greedy_copies: bool = False

    def __post_init__(self) -> None:
        # Each value is stored as the plain Python type its check returns (numpy and Python numbers are both
        # accepted), so everything downstream sees ints, floats and lists of ints.
        _store(self, "max_new_tokens", self._checked_budget())
        rows = require_int("continuous_batch_size", self.continuous_batch_size, 1, "use at least one row")
        _store(self, "continuous_batch_size", rows)
        penalty = require_finite("repetition_penalty", self.repetition_penalty, "1.0 disables it")
        if penalty <= 0:
            raise ValueError(f"repetition_penalty={penalty!r} is invalid: it must be > 0 (1.0 disables it)")
        _store(self, "repetition_penalty", penalty)
        temperature = require_finite("temperature", self.temperature, "use 0.0 for greedy decoding")
        if temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} is invalid: use 0.0 (greedy) or a positive value")
        _store(self, "temperature", temperature)
        _store(self, "top_k", require_int("top_k", self.top_k, 0, "0 disables top-k"))
        top_p = require_finite("top_p", self.top_p, "1.0 disables top-p")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} is invalid: it must be in (0, 1] (1.0 disables top-p)")
        _store(self, "top_p", top_p)
        self._check_warpers()
        _store(self, "n", require_int("n", self.n, 1, "ask for at least one sample per prompt"))
        _store(self, "seed", self._checked_seed())
        require_bool("logprobs", self.logprobs)
        require_choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        _store(self, "eos_token_id", self._checked_eos())
        _store(self, "stop_strings", checked_stop_strings("stop_strings", self.stop_strings))
        fix = "None takes the model's generation config, 0 turns it off"
        _store(self, "min_new_tokens", optional_int("min_new_tokens", self.min_new_tokens, 0, fix))
        require_bool("greedy_copies", self.greedy_copies)
        self._check_greedy()

    def _check_greedy(self) -> None:
        """Sampling-only options with greedy decoding are refused, not ignored: n identical samples give a
        GRPO trainer zero advantages, and a warper set means sampling was meant."""
        if self.temperature > 0:
            return
        ignored = [
            f"{name}={getattr(self, name)!r}" for name, off in _SAMPLING_ONLY.items() if getattr(self, name) != off
        ]
        if ignored:
            raise ValueError(
                f"{', '.join(ignored)} only act when sampling, and temperature=0.0 is greedy decoding: set "
                "temperature > 0 (e.g. temperature=1.0) to sample, or leave them at their defaults for greedy"
            )
        if self.n > 1 and not self.greedy_copies:
            raise ValueError(
                f"n={self.n} with temperature=0.0 (greedy) gives {self.n} identical samples of every prompt: set "
                "temperature > 0 (e.g. temperature=1.0) to sample them, or greedy_copies=True if identical copies "
                "are what you want"
            )

    def _check_warpers(self) -> None:
        for name, (inside, bounds, off) in _WARPER_RANGES.items():
            value = require_finite(name, getattr(self, name), f"{off} disables it")
            if not inside(value):
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is invalid: it must be in {bounds} ({off} disables it)"
                )
            _store(self, name, value)

    @property
    def most_new_tokens(self) -> int:
        """The largest per-request budget: what bounds a call's decode steps and cache columns."""
        budget = self.max_new_tokens
        # an empty list is valid only for a call without prompts, which generates nothing
        return max(budget, default=1) if isinstance(budget, list) else budget

    def request_budgets(self, prompt_count: int) -> tuple[int, ...]:
        """Every prompt's new-token budget for a call of `prompt_count` prompts."""
        budget = self.max_new_tokens
        if not isinstance(budget, list):
            return (budget,) * prompt_count
        if len(budget) != prompt_count:
            raise ValueError(
                f"max_new_tokens has {len(budget)} values for {prompt_count} prompts: pass one per prompt or one "
                "int for all"
            )
        return tuple(budget)

    def _checked_budget(self) -> int | list[int]:
        budget = plain_int_or_list(self.max_new_tokens)
        if budget is None or min(budget if isinstance(budget, list) else [budget], default=1) < 1:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens!r} is invalid: pass an int >= 1 or a list of them, one per "
                "prompt; ask for at least one new token"
            )
        return budget

    def _checked_seed(self) -> int | list[int]:
        seed = plain_int_or_list(self.seed)
        if seed is None or not all(0 <= value < 2**64 for value in (seed if isinstance(seed, list) else [seed])):
            raise ValueError(
                f"seed={self.seed!r} is invalid: pass an int in [0, 2**64) or a list of them, one per prompt"
            )
        return seed

    def _checked_eos(self) -> int | list[int] | None:
        if self.eos_token_id is None:
            return None
        ids = plain_int_or_list(self.eos_token_id)
        if ids is None or any(i < 0 for i in (ids if isinstance(ids, list) else [ids])):
            raise ValueError(
                f"eos_token_id={self.eos_token_id!r} is invalid: pass a non-negative int, a list of them "
                "([] disables EOS), or None for the model's generation config"
            )
        return ids


def checked_stop_strings(name: str, value: object) -> str | list[str] | None:
    """`value` as None, one non-empty string, or a list of them (any sequence of strings becomes a list)."""
    if value is None or (isinstance(value, str) and value):
        return value
    strings = list(value) if isinstance(value, (list, tuple)) else None
    if strings is None or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(
            f"{name}={value!r} is invalid: pass a non-empty string, a list of them ([] disables stop strings), "
            "or None for the model's generation config"
        )
    return strings


def _op_backends(value: object) -> Mapping[str, str] | None:
    """`op_backends` as a read-only mapping of strings (None stays None); TypeError otherwise."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TypeError(
            f"op_backends={value!r} is invalid: pass a dict of op family -> backend name, both strings, e.g. "
            '{"rms_norm": "cpu"}'
        )
    return MappingProxyType(dict(value))


def _store(config: RolloutConfig | SamplingConfig, name: str, value: object) -> None:
    """Set a frozen config's field to its checked, plain-Python value (only ever from `__post_init__`)."""
    object.__setattr__(config, name, value)


def sampling_or_default(sampling: SamplingConfig | None) -> SamplingConfig:
    """The call's SamplingConfig (defaults when None); anything else is a TypeError."""
    if sampling is None:
        return SamplingConfig()
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    return sampling
