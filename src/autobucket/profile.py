"""`Profile`: what one `generate` call did and what it cost.

Counters (forwards, groups, bytes) are always exact. Phase times (`prefill_ms`, `decode_ms`,
`cache_ms`) are host wall-clock; on a GPU they only mean something with `RolloutConfig(profile=True)`,
which synchronises the device at phase boundaries. `total_ms` is the wall time of the whole call,
planning and result normalisation included, and always ends with a device sync.

`timings` lists every event the cost model describes (each prefill forward, KV copy and decode step,
with its shape and ms); online cost learning feeds on them. `predicted_ms` is what the coefficients in
`costs` (from `costs_source`) predict for those same events, `measured_ms` their measured sum: the
two agree when the cost model is right for this machine."""

from __future__ import annotations

import copy
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Timing:
    """One measured event: `kind` (see `costs.coefficients.TIMING_KINDS`), its rows, width (prefill: padded
    tokens; KV copy: prompt tokens; decode step: KV columns attended) and wall ms."""

    kind: str
    rows: int
    width: int
    ms: float


@dataclass
class Profile:
    route: str = ""
    # the call's forward plan (`engine/plan`): op family -> backend, "decode_step", "reasons" (op -> why)
    plan: dict[str, Any] = field(default_factory=dict)
    prefill_groups: list[list[list[int]]] = field(default_factory=list)  # per admission, its prefill groups' prompt indices
    prefill_forms: list[list[str]] = field(default_factory=list)  # per admission, each bucket's form
    prefill_forwards: int = 0
    prefill_tokens: int = 0  # padded token positions run through prefill
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not prefilled)
    prefix_cache_hits: int = 0  # prompts served a cached prefix
    prefix_cache_evictions: int = 0  # cache blocks evicted by this call (least recently used first)
    prefix_cache_bytes: int = 0  # K/V the prefix cache holds after the call
    prefix_cache_invalidations: int = 0  # 1 when this call found the weights changed and cleared the cache
    shared_prefixes: int = 0  # prefixes shared by several prompts of an admission, each prefilled once
    shared_prompt_tokens: int = 0  # prompt tokens whose K/V came from such a shared prefill (not their own)
    shared_kv_rows: int = 0  # cache rows that read their prompt's one shared K/V copy (n samples, cascade decode)
    decode_forwards: int = 0
    # CB routes: the forward eager decode steps take (a compiled step takes neither): "direct", the model's
    # parts (Llama family, `engine/decode/step.py`, bitwise its forward), or "model"
    decode_forward: str = ""
    plan_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    cache_ms: float = 0.0
    total_ms: float = 0.0
    output_tokens: int = 0
    tokens_per_s: float = 0.0
    kv_cache_bytes: int = 0
    peak_memory_bytes: int = 0  # the device's high-water mark after the call (never reset by autobucket)
    peak_memory_growth_bytes: int = 0  # how far this call raised that mark (0: it stayed under an earlier peak)
    trims: int = 0
    trimmed_columns: int = 0
    moved_bytes: int = 0
    max_active_rows: int = 0
    cache_capacity: int = 0  # static cache columns (0 for the ordinary route)
    estimated_ordinary_ms: float | None = None
    estimated_bucketed_ms: float | None = None
    decision_reason: str = ""
    costs_source: str = ""  # file, given, defaults (the reference's GPU values), probe, stored or online
    costs: dict[str, float] = field(default_factory=dict)  # the coefficients this call planned with
    predicted_ms: float | None = None  # the cost model's ms for this call's timed events
    measured_ms: float = 0.0  # the measured ms of the same events (sum of `timings`)
    timings: list[Timing] = field(default_factory=list, repr=False)
    compile_ms: float = 0.0  # steps that compiled a decode graph (not counted in decode_ms)
    compiled_graphs: int = 0  # decode shapes compiled by this call
    recompiles: int = 0  # already compiled shapes compiled again (guard failures)
    compiled_steps: int = 0  # decode steps that ran a compiled graph
    eager_steps: int = 0  # decode steps run eagerly although compiling was on (new shape not compiled, fallback)
    compile_fallback: str = ""  # why compiled decoding was off or stopped ("" when it was not)
    compile_decision: str = ""
    kernels: str = ""  # the kernels setting the call ran: "invariant", "torch", or "auto" where it fell back
    kernels_reason: str = ""  # why that set (`engine/kernel_choice.py`)
    packs_made: int = 0  # linear weights packed by this call (kernels="invariant"): first packs and repacks
    pack_ms: float = 0.0  # their cost (a repack follows every in-place weight update)
    packed_weight_bytes: int = 0  # the packed copies held after the call

    @property
    def prefill_buckets(self) -> list[list[list[int]]]:
        """Deprecated name of `prefill_groups` (one name for prompts prefilled together)."""
        import warnings

        warnings.warn("Profile.prefill_buckets is now Profile.prefill_groups", DeprecationWarning, stacklevel=2)
        return self.prefill_groups

    def to_dict(self) -> dict[str, Any]:
        """Every field but the raw `timings` (one entry per decode step: long)."""
        return copy.deepcopy({f.name: getattr(self, f.name) for f in fields(self) if f.name != "timings"})

    def record(self, kind: str, rows: int, width: int, started: float) -> None:
        """Append a `Timing` of `kind` that began at `time.perf_counter()` value `started`."""
        self.timings.append(Timing(kind, rows, width, (time.perf_counter() - started) * 1e3))


class PhaseTimer:
    """Adds wall time of `with timer.phase("decode_ms"):` blocks to a Profile field."""

    def __init__(self, profile: Profile, device: torch.device, synchronize: bool) -> None:
        self.profile, self.device, self.synchronize = profile, device, synchronize

    def sync(self) -> None:
        if self.synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str):
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            setattr(self.profile, name, getattr(self.profile, name) + (time.perf_counter() - start) * 1e3)


class PeakMemory:
    """Peak memory over a call, read without resetting anything the process (the trainer) owns.

    The reading is the device's high-water mark after the call — CUDA's allocator peak, or on CPU the
    process's peak RSS (VmHWM) — and `growth_bytes` how far the call raised it (0 when the call stayed
    under an earlier peak). Resetting the marks per call (`torch.cuda.reset_peak_memory_stats`,
    /proc/self/clear_refs) would clobber the trainer's own memory logging; a benchmark that owns its
    process calls `reset_peak_memory` itself before each contender."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.before_bytes = 0

    def __enter__(self) -> PeakMemory:
        self.before_bytes = self.peak_bytes()
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @property
    def growth_bytes(self) -> int:
        return max(0, self.peak_bytes() - self.before_bytes)

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return _cpu_peak_rss_bytes()


def _cpu_peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_memory(device: torch.device) -> None:
    """Reset the device's high-water mark (CUDA allocator peak; on Linux the RSS peak). For benchmarks that
    own their process — the engine itself never calls it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass
