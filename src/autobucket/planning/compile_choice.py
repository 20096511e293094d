"""Whether one call makes graphs of its decode step, and of which form (pure Python, never imports torch).

A *graph form* pays once per new decode shape and then runs every step at a fraction of the eager step's
time: the `torch.compile`d step ("compiled", a compile per shape) or, where one plugs in, a captured CUDA
graph (a cheap capture per shape, a replay that drops the host's launch time). Shapes a form already holds
cost nothing, so a call reuses them whenever graphs are allowed at all; "auto" makes *new* graphs only when
the call's predicted saving exceeds their predicted cost, for the form that nets the most:

    saving_ms(form) = decode_steps · eager_step_ms(rows) · (1 - step_fraction(form))
    cost_ms(form)   = new_graphs(form) · graph_ms(form)

Each figure is the one measured on the call's device where there is one (`MeasuredFigures`: the eager
step at the call's row count, the durations of the form's graphs made so far, its step time against the
eager step's; kept per device, model geometry, kernel set and dtype by `costs.decode_figures`). Until a
figure is measured its prior stands in: `CompileCosts`, constants set from one CPU's timings
(docs/benchmarks.md), orders of magnitude off on a GPU or another CPU:

    eager_step_ms(rows) = step_fixed_ms + step_ms_per_gflop · 2 · parameters · rows / 1e9

The decision's `figures` (repeated in its reason) says which figures were measured, where, and which were
the prior's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autobucket.checks import require_choice, require_finite, require_int

COMPILE_SETTINGS = ("auto", True, False)
COMPILED = "compiled"  # the torch.compile'd decode step: the form `compile=` names
PRIOR = "prior"


@dataclass(frozen=True, slots=True)
class CompileCosts:
    """The prior: what the decision assumes before anything was measured on the call's device."""

    graph_compile_ms: float = 30_000.0  # one decode graph, inductor on CPU (varies with the machine's load)
    step_fixed_ms: float = 2.0  # eager decode step at zero FLOPs (Python + launch overhead)
    step_ms_per_gflop: float = 30.0  # eager decode step per GFLOP of 2 * parameters * rows (one CPU core's rate)
    compiled_fraction: float = 0.85  # compiled step time / eager step time (a decode step of 32 rows)

    def __post_init__(self) -> None:
        for name in ("graph_compile_ms", "step_fixed_ms", "step_ms_per_gflop"):
            require_finite(name, getattr(self, name), "pass a finite number >= 0", minimum=0.0)
        require_finite("compiled_fraction", self.compiled_fraction, "pass a ratio in [0, 1]", minimum=0.0)


@dataclass(frozen=True, slots=True)
class GraphForm:
    """One graph form a call may use, with its prior figures: `graph_ms` to make one graph, `step_fraction`
    its step time over the eager step's (above 1: slower than eager), `new_graphs` the call would add."""

    name: str
    new_graphs: int
    graph_ms: float
    step_fraction: float

    def __post_init__(self) -> None:
        require_int(f"{self.name}.new_graphs", self.new_graphs, 0)
        require_finite(f"{self.name}.graph_ms", self.graph_ms, "pass a finite number >= 0", minimum=0.0)
        require_finite(f"{self.name}.step_fraction", self.step_fraction, "pass a ratio >= 0", minimum=0.0)


@dataclass(frozen=True, slots=True)
class FormFigures:
    """A graph form's figures measured on the device; None where nothing was measured yet."""

    graph_ms: float | None = None  # median duration of one new graph (compile or capture)
    graphs: int = 0  # graphs that median is over
    step_fraction: float | None = None  # its step time / the eager step's at the same rows
    steps: int = 0  # form steps that ratio is over

    def __post_init__(self) -> None:
        _check_optional("graph_ms", self.graph_ms)
        _check_optional("step_fraction", self.step_fraction)
        require_int("graphs", self.graphs, 0)
        require_int("steps", self.steps, 0)


@dataclass(frozen=True, slots=True)
class MeasuredFigures:
    """What was measured on `device` for a call's key and row count (`costs.decode_figures`)."""

    device: str  # where: "cuda:0", "cpu"
    rows: int  # the row count `eager_step_ms` is for
    eager_step_ms: float | None = None  # median eager decode step at `rows` rows
    eager_steps: int = 0  # steps that median is over
    forms: Mapping[str, FormFigures] = field(default_factory=dict)  # graph form name -> its figures

    def __post_init__(self) -> None:
        _check_optional("eager_step_ms", self.eager_step_ms)
        require_int("eager_steps", self.eager_steps, 0)
        require_int("rows", self.rows, 0)


def _check_optional(name: str, value: float | None) -> None:
    if value is not None:
        require_finite(name, value, "a measured figure is a finite number >= 0", minimum=0.0)


@dataclass(frozen=True, slots=True)
class CompileDecision:
    use_compiled: bool  # decode shapes the form already holds run as graphs
    compile_new: bool  # shapes it does not hold yet are made (else they run eagerly)
    saving_ms: float  # predicted decode time saved if every step ran as the form's graph
    compile_ms: float  # predicted time to make the new graphs
    reason: str
    form: str = COMPILED  # the graph form the two flags are about
    figures: str = PRIOR  # which figures the prediction used: measured (where) or the prior


@dataclass(frozen=True, slots=True)
class _Weighed:
    """One form's prediction for the call, its figures resolved (measured, else prior)."""

    form: GraphForm
    step_fraction: float  # resolved: measured, else the form's prior
    saving_ms: float
    cost_ms: float
    figures: str

    @property
    def net_ms(self) -> float:
        return self.saving_ms - self.cost_ms


def eager_step_ms(parameters: int, rows: int, costs: CompileCosts) -> float:
    """The prior's eager decode step."""
    return costs.step_fixed_ms + costs.step_ms_per_gflop * 2.0 * parameters * rows / 1e9


def compiled_form(new_graphs: int, costs: CompileCosts) -> GraphForm:
    """The `torch.compile` form with the prior's figures."""
    return GraphForm(COMPILED, new_graphs, costs.graph_compile_ms, costs.compiled_fraction)


def choose_compile(
    setting: bool | str,
    parameters: int,
    rows: int,
    decode_steps: int,
    new_graphs: int,
    costs: CompileCosts = CompileCosts(),
    *,
    measured: MeasuredFigures | None = None,
    other_forms: Sequence[GraphForm] = (),
) -> CompileDecision:
    """The graph decision for one call of `decode_steps` steps of up to `rows` rows, `new_graphs` of them
    new to the compiled form; `measured`: the figures measured for the call's key (None: the prior's);
    `other_forms`: further graph forms "auto" may choose instead (`compile=True` is the compiled form)."""
    require_choice("compile", setting, COMPILE_SETTINGS)
    for name, value in (("parameters", parameters), ("rows", rows), ("decode_steps", decode_steps), ("new_graphs", new_graphs)):
        require_int(name, value, 0)
    step_ms, step_figures = _eager_step(parameters, rows, costs, measured)
    forms = (compiled_form(new_graphs, costs), *other_forms)
    weighed = [_weigh(form, decode_steps, step_ms, step_figures, measured) for form in forms]
    compiled = weighed[0]
    if setting is False:
        return CompileDecision(False, False, compiled.saving_ms, compiled.cost_ms, "compile=False", COMPILED, compiled.figures)
    if setting is True:
        return CompileDecision(True, True, compiled.saving_ms, compiled.cost_ms, "compile=True", COMPILED, compiled.figures)
    return _auto(weighed)


def _eager_step(parameters: int, rows: int, costs: CompileCosts, measured: MeasuredFigures | None) -> tuple[float, str]:
    if measured is not None and measured.eager_step_ms is not None:
        where = f"measured on {measured.device} at {measured.rows} rows ({measured.eager_steps} steps)"
        return measured.eager_step_ms, f"eager step {_ms(measured.eager_step_ms)} ms {where}"
    step_ms = eager_step_ms(parameters, rows, costs)
    return step_ms, f"eager step {_ms(step_ms)} ms {PRIOR}"


def _weigh(form: GraphForm, steps: int, step_ms: float, step_figures: str, measured: MeasuredFigures | None) -> _Weighed:
    found = measured.forms.get(form.name, FormFigures()) if measured is not None else FormFigures()
    device = measured.device if measured is not None else ""
    graph_ms, graph_text = _figure(found.graph_ms, form.graph_ms, f"on {device} ({found.graphs} graphs)")
    fraction, fraction_text = _figure(found.step_fraction, form.step_fraction, f"on {device} ({found.steps} steps)")
    figures = (f"{step_figures}; {form.name}: {_ms(graph_ms)} ms a graph {graph_text}, "
               f"step {fraction:.3g} of eager {fraction_text}")
    saving_ms = steps * step_ms * max(0.0, 1.0 - fraction)
    return _Weighed(form, fraction, saving_ms, form.new_graphs * graph_ms, figures)


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _figure(measured: float | None, prior: float, where: str) -> tuple[float, str]:
    return (prior, PRIOR) if measured is None else (measured, f"measured {where}")


def _auto(weighed: list[_Weighed]) -> CompileDecision:
    """The form netting the most, when that is a gain; else the compiled form's existing shapes with new
    shapes eager, or no graphs at all where its step is predicted no faster than the eager one."""
    best = max(weighed, key=lambda option: option.net_ms)  # ties: the first, the compiled form
    if best.net_ms > 0:
        return _decision(best, True, best.form.new_graphs > 0, _verdict(best))
    compiled = weighed[0]
    if compiled.step_fraction >= 1.0:
        return _decision(compiled, False, False, "auto: eager (the compiled step is predicted no faster)")
    if compiled.form.new_graphs == 0:
        return _decision(compiled, True, False, "auto: every decode shape is already compiled")
    verdict = f"reuse compiled shapes only (predicted saving {compiled.saving_ms:.0f} ms vs "
    return _decision(compiled, True, False, f"auto: {verdict}{compiled.form.new_graphs} new graphs ~{compiled.cost_ms:.0f} ms)")


def _verdict(option: _Weighed) -> str:
    name, new = option.form.name, option.form.new_graphs
    if new == 0:
        return "auto: every decode shape is already compiled" if name == COMPILED else f"auto: {name} (every decode shape already has a graph)"
    verb = "compile" if name == COMPILED else name
    return f"auto: {verb} (predicted saving {option.saving_ms:.0f} ms vs {new} new graphs ~{option.cost_ms:.0f} ms)"


def _decision(option: _Weighed, use: bool, new: bool, reason: str) -> CompileDecision:
    return CompileDecision(use, new, option.saving_ms, option.cost_ms, f"{reason} [{option.figures}]", option.form.name, option.figures)
