"""Whether one call compiles its decode step (pure Python, never imports torch).

Compiling pays once per new decode shape (tens of seconds on a CPU) and saves a fraction of every
decode step afterwards. Shapes already compiled for the model cost nothing, so a call reuses them
whenever compilation is allowed at all; "auto" compiles *new* shapes only when the call's predicted
saving exceeds their predicted compile time:

    saving_ms  = decode_steps · eager_step_ms(rows) · (1 - compiled_fraction)
    compile_ms = new_graphs · graph_compile_ms
    eager_step_ms(rows) = step_fixed_ms + step_ms_per_gflop · 2 · parameters · rows / 1e9

The coefficients are this module's own (set from one CPU's timings, docs/benchmarks.md), not
calibrated per model: the decision is coarse by design, since one compile costs as much as thousands
of decode steps of a small model."""

from __future__ import annotations

from dataclasses import dataclass

from autobucket.checks import require_choice, require_finite, require_int

COMPILE_SETTINGS = ("auto", True, False)


@dataclass(frozen=True, slots=True)
class CompileCosts:
    graph_compile_ms: float = 30_000.0  # one decode graph, inductor on CPU (varies with the machine's load)
    step_fixed_ms: float = 2.0  # eager decode step at zero FLOPs (Python + launch overhead)
    step_ms_per_gflop: float = 30.0  # eager decode step per GFLOP of 2 * parameters * rows (one CPU core's rate)
    compiled_fraction: float = 0.85  # compiled step time / eager step time (a decode step of 32 rows)

    def __post_init__(self) -> None:
        for name in ("graph_compile_ms", "step_fixed_ms", "step_ms_per_gflop"):
            require_finite(name, getattr(self, name), "pass a finite number >= 0", minimum=0.0)
        require_finite("compiled_fraction", self.compiled_fraction, "pass a ratio in [0, 1]", minimum=0.0)


@dataclass(frozen=True, slots=True)
class CompileDecision:
    use_compiled: bool  # decode shapes already compiled for this model run compiled
    compile_new: bool  # shapes not yet compiled are compiled (else they run eagerly)
    saving_ms: float  # predicted decode time saved if every step ran compiled
    compile_ms: float  # predicted compile time of the new shapes
    reason: str


def eager_step_ms(parameters: int, rows: int, costs: CompileCosts) -> float:
    return costs.step_fixed_ms + costs.step_ms_per_gflop * 2.0 * parameters * rows / 1e9


def choose_compile(
    setting: bool | str,
    parameters: int,
    rows: int,
    decode_steps: int,
    new_graphs: int,
    costs: CompileCosts = CompileCosts(),
) -> CompileDecision:
    """The compile decision for one call of `decode_steps` steps of up to `rows` rows."""
    require_choice("compile", setting, COMPILE_SETTINGS)
    for name, value in (("parameters", parameters), ("rows", rows), ("decode_steps", decode_steps), ("new_graphs", new_graphs)):
        require_int(name, value, 0)
    saving_ms = decode_steps * eager_step_ms(parameters, rows, costs) * max(0.0, 1.0 - costs.compiled_fraction)
    compile_ms = new_graphs * costs.graph_compile_ms
    if setting is False:
        return CompileDecision(False, False, saving_ms, compile_ms, "compile=False")
    if setting is True:
        return CompileDecision(True, True, saving_ms, compile_ms, "compile=True")
    if new_graphs == 0:
        return CompileDecision(True, False, saving_ms, 0.0, "auto: every decode shape is already compiled")
    repays = saving_ms > compile_ms
    verdict = "compile" if repays else "reuse compiled shapes only"
    reason = f"auto: {verdict} (predicted saving {saving_ms:.0f} ms vs {new_graphs} new graphs ~{compile_ms:.0f} ms)"
    return CompileDecision(True, repays, saving_ms, compile_ms, reason)
