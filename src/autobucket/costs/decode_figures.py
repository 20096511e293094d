"""Decode figures measured on the device, per key, in this process: what the compile decision
(`planning.compile_choice`) reads instead of its CPU prior.

A key is what a step's time depends on (`FiguresKey`): the device and its kind (the GPU's name; the host
CPU's kind and thread count), the model's geometry (its config hash), dtype, attention backend and kernel
set. A second model, device or kernel set never reads another's figures. Per key the store keeps:

* the eager decode step's time per row count: first from a short probe at the call's row count
  (`probe_eager_steps`: the engine's own eager step, in a continuous-batching call of short prompts), then
  from the steps of every call that decoded eagerly (calls with `compile=False` weigh nothing and feed
  nothing);
* each graph form's step times per row count (steps that replayed a graph; a step that made one is never
  among them): its step fraction is the median, over the row counts both were measured at, of the form's
  median step over the eager median step;
* each graph form's durations per new graph (a compile, a capture), recorded from every call that made one.

A step's time is wall time from its start to its one host read of the sampled tokens, which waits for the
device, so on a GPU it holds the device's work and the host's launches alike: what a replayed graph saves
is host time that device events would not show.

Kept in the process only, not in the online-cost store: a compile's duration depends on the compiler's
on-disk caches (the process that fills them pays most), and the eager figure is a probe of a few steps
away. The lock makes one store safe for several `Rollout`s on several threads.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from autobucket.checks import require_finite, require_int
from autobucket.config import SamplingConfig
from autobucket.costs.calibration_file import host_cpu, model_metadata
from autobucket.costs.coefficients import CB_STEP
from autobucket.costs.source import RunRoute
from autobucket.planning.compile_choice import COMPILED, FormFigures, MeasuredFigures
from autobucket.profile import Profile, Timing
from autobucket.prompts import random_prompts

EAGER = "eager"  # the steps every graph form is measured against
STEP_WINDOW = 256  # step times kept per (key, form, rows): recent calls outweigh the probe
GRAPH_WINDOW = 32  # graph durations kept per (key, form)
PROBE_PROMPT_TOKENS = 8  # the probe's prompts: short, so its prefill costs little next to its steps
PROBE_STEPS = 6  # decode steps the probe times (the first one's warm-up is one sample of a median)


@dataclass(frozen=True, slots=True)
class FiguresKey:
    device: str  # the device the steps ran on, as the decision's reason names it: "cuda:0", "cpu"
    device_kind: str  # what that device is: the GPU's name, or the host CPU's kind and thread count
    config_hash: str  # the model's geometry
    dtype: str
    attention: str
    kernels: str  # the kernel set the steps ran ("torch", "invariant", "triton")


def figures_key(model: torch.nn.Module, kernels: str) -> FiguresKey:
    """The key of `model` as it is now (a trainer may move it or change its dtype between calls)."""
    device = next(model.parameters()).device
    metadata = model_metadata(model)
    kind = metadata["device"] if device.type == "cuda" else f"{host_cpu()} threads {torch.get_num_threads()}"
    return FiguresKey(str(device), kind, metadata["config_hash"], metadata["dtype"], metadata["attn_implementation"], kernels)


@dataclass
class _KeyFigures:
    steps: dict[tuple[str, int], deque[float]] = field(default_factory=dict)  # (form, rows) -> step ms
    graphs: dict[str, deque[float]] = field(default_factory=dict)  # form -> ms per new graph


class DecodeFigures:
    """The figures measured in this process, per `FiguresKey` (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[FiguresKey, _KeyFigures] = {}

    def record_steps(self, key: FiguresKey, form: str, rows: int, step_ms: Iterable[float]) -> None:
        """Step times of `form` ("eager" or a graph form) at `rows` rows; all refused if one is not a
        finite number >= 0."""
        rows = require_int("rows", rows, 1)
        checked = [require_finite("step_ms", ms, "a step time is a finite number >= 0", minimum=0.0) for ms in step_ms]
        with self._lock:
            kept = self._keys.setdefault(key, _KeyFigures()).steps.setdefault((form, rows), deque(maxlen=STEP_WINDOW))
            kept.extend(checked)

    def record_graphs(self, key: FiguresKey, form: str, graph_ms: Iterable[float]) -> None:
        """Durations of new graphs of `form` (one each); all refused if one is not a finite number >= 0."""
        checked = [require_finite("graph_ms", ms, "a graph's duration is a finite number >= 0", minimum=0.0)
                   for ms in graph_ms]
        with self._lock:
            self._keys.setdefault(key, _KeyFigures()).graphs.setdefault(form, deque(maxlen=GRAPH_WINDOW)).extend(checked)

    def record_call(self, key: FiguresKey, profile: Profile) -> None:
        """What one continuous-batching call measured: its decode steps (when all ran in one form) and the
        graphs it compiled."""
        form = steps_form(profile)
        if form is not None:
            for rows, step_ms in _steps_by_rows(profile.timings).items():
                self.record_steps(key, form, rows, step_ms)
        made = profile.compiled_graphs + profile.recompiles
        if made and profile.compile_ms > 0:
            self.record_graphs(key, COMPILED, [profile.compile_ms / made] * made)

    def has_eager_step(self, key: FiguresKey, rows: int) -> bool:
        with self._lock:
            found = self._keys.get(key)
            return found is not None and bool(found.steps.get((EAGER, rows)))

    def figures(self, key: FiguresKey, rows: int) -> MeasuredFigures:
        """What was measured for `key`: the eager step at `rows` rows and each graph form's figures."""
        with self._lock:
            found = self._keys.get(key, _KeyFigures())
            medians = {place: statistics.median(ms) for place, ms in found.steps.items() if ms}
            counts = {place: len(ms) for place, ms in found.steps.items()}
            graphs = {form: list(ms) for form, ms in found.graphs.items() if ms}
        eager = medians.get((EAGER, rows))
        names = {form for form, _ in medians if form != EAGER} | set(graphs)
        forms = {name: _form_figures(name, rows, medians, counts, graphs.get(name, [])) for name in sorted(names)}
        return MeasuredFigures(key.device, rows, eager, counts.get((EAGER, rows), 0) if eager is not None else 0, forms)


def steps_form(profile: Profile) -> str | None:
    """The form every timed decode step of a call ran in: eager (no compiled step), compiled (no eager
    step while compiling was on), else None (a mix whose timings cannot be told apart)."""
    if profile.compiled_steps == 0:
        return EAGER
    return COMPILED if profile.eager_steps == 0 else None


def _steps_by_rows(timings: Iterable[Timing]) -> dict[int, list[float]]:
    by_rows: dict[int, list[float]] = {}
    for timing in timings:
        if timing.kind == CB_STEP:
            by_rows.setdefault(timing.rows, []).append(timing.ms)
    return by_rows


def _form_figures(
    name: str, rows: int, medians: dict[tuple[str, int], float], counts: dict[tuple[str, int], int], graphs: list[float]
) -> FormFigures:
    """A form's graph median and step fraction: at `rows` where both it and the eager step were measured
    there, else the median over the row counts where both were."""
    shared = sorted(r for form, r in medians if form == name and (EAGER, r) in medians and medians[(EAGER, r)] > 0)
    used = [rows] if rows in shared else shared
    fraction = statistics.median(medians[(name, r)] / medians[(EAGER, r)] for r in used) if used else None
    return FormFigures(
        graph_ms=statistics.median(graphs) if graphs else None,
        graphs=len(graphs),
        step_fraction=fraction,
        steps=sum(counts[(name, r)] for r in used),
    )


PROCESS_FIGURES = DecodeFigures()  # every Rollout of this process reads and feeds this one


@dataclass
class CompileFigures:
    """What one call's compile decision reads: the store at the call's key, the eager step probed first
    where nothing was measured at the call's row count."""

    store: DecodeFigures
    key: FiguresKey
    probe: Callable[[int], list[Timing]] | None = None  # rows -> the eager decode steps of a short call

    def measured(self, rows: int, probe: bool) -> MeasuredFigures:
        """The figures at `rows` rows; `probe`: measure the eager step now if it was not measured yet."""
        if probe and self.probe is not None and not self.store.has_eager_step(self.key, rows):
            timings = [t.ms for t in self.probe(rows) if t.kind == CB_STEP and t.rows == rows]
            self.store.record_steps(self.key, EAGER, rows, timings)
        return self.store.figures(self.key, rows)

    def record_call(self, profile: Profile) -> None:
        self.store.record_call(self.key, profile)


def probe_eager_steps(run: RunRoute, rows: int, vocab_size: int) -> list[Timing]:
    """The engine's eager decode steps at `rows` rows: one equal-width call (`run` decodes eagerly) of
    `rows` short prompts, PROBE_STEPS decode steps each, nothing stopping a row early."""
    sampling = SamplingConfig(max_new_tokens=PROBE_STEPS + 1, continuous_batch_size=rows, eos_token_id=[], stop_strings=[])
    # ids below 256 are ordinary tokens in any vocabulary (clear of the special ids at the top of many)
    prompts = random_prompts([PROBE_PROMPT_TOKENS] * rows, min(256, vocab_size), seed=rows)
    return [timing for timing in run("equal_width", prompts, sampling).timings if timing.kind == CB_STEP]
