"""The compile decision on figures measured on the device, against its formula recomputed here:
the prior before anything is measured, measured figures flipping it, a second graph form plugged in,
and bad figures refused."""

from __future__ import annotations

import itertools
import math

import pytest

from autobucket.planning.compile_choice import (
    CompileCosts,
    FormFigures,
    GraphForm,
    MeasuredFigures,
    choose_compile,
)

PARAMETERS, ROWS, STEPS = 20_000_000, 32, 500
PRIOR = CompileCosts()


def _prior_eager_ms(parameters: int, rows: int) -> float:
    return PRIOR.step_fixed_ms + PRIOR.step_ms_per_gflop * 2 * parameters * rows / 1e9


def _measured(eager_ms=None, graph_ms=None, fraction=None, device="cuda:0", forms=None) -> MeasuredFigures:
    compiled = FormFigures(graph_ms, 3 if graph_ms is not None else 0, fraction, 40 if fraction is not None else 0)
    return MeasuredFigures(device, ROWS, eager_ms, 12 if eager_ms is not None else 0, forms or {"compiled": compiled})


def test_before_anything_is_measured_the_prior_decides_and_is_named():
    decision = choose_compile("auto", PARAMETERS, ROWS, STEPS, new_graphs=2)
    saving = STEPS * _prior_eager_ms(PARAMETERS, ROWS) * (1 - PRIOR.compiled_fraction)
    assert decision.saving_ms == pytest.approx(saving) and decision.compile_ms == 2 * PRIOR.graph_compile_ms
    assert decision.compile_new == (saving > 2 * PRIOR.graph_compile_ms)
    assert "measured" not in decision.figures and decision.figures.count("prior") == 3
    assert decision.figures in decision.reason and decision.form == "compiled"
    empty = choose_compile("auto", PARAMETERS, ROWS, STEPS, 2, measured=MeasuredFigures("cuda:0", ROWS))
    assert empty == decision  # figures measured for nothing yet: the prior, named as such


@pytest.mark.parametrize(("eager_ms", "graph_ms", "fraction"), list(itertools.product((0.5, 8.0, 60.0), (300.0, 40_000.0), (0.25, 0.9))))
def test_measured_figures_decide_by_the_formula(eager_ms, graph_ms, fraction):
    decision = choose_compile("auto", PARAMETERS, ROWS, STEPS, 3, measured=_measured(eager_ms, graph_ms, fraction))
    saving = STEPS * eager_ms * (1 - fraction)
    assert decision.saving_ms == pytest.approx(saving) and decision.compile_ms == pytest.approx(3 * graph_ms)
    assert (decision.use_compiled, decision.compile_new) == (True, saving > 3 * graph_ms)
    assert "measured on cuda:0 at 32 rows (12 steps)" in decision.reason
    assert "measured on cuda:0 (3 graphs)" in decision.reason and "measured on cuda:0 (40 steps)" in decision.reason


def test_a_measured_eager_step_flips_what_the_prior_decided():
    """A 0.5B geometry at 64 rows: the CPU prior's eager step is slow enough that compiling repays; the
    step measured on a GPU is not, until a compile measured that short says otherwise."""
    parameters, rows, steps = 494_000_000, 64, 2000
    prior = choose_compile("auto", parameters, rows, steps, 1)
    assert prior.compile_new and prior.saving_ms == pytest.approx(steps * _prior_eager_ms(parameters, rows) * 0.15)
    gpu = MeasuredFigures("cuda:0", rows, 25.0, 6, {})
    measured = choose_compile("auto", parameters, rows, steps, 1, measured=gpu)
    assert not measured.compile_new and measured.use_compiled and "reuse compiled shapes only" in measured.reason
    assert measured.saving_ms == pytest.approx(steps * 25.0 * (1 - PRIOR.compiled_fraction))
    assert "eager step 25 ms measured on cuda:0 at 64 rows (6 steps)" in measured.reason
    assert "compiled: 30000 ms a graph prior" in measured.figures  # no compile measured yet
    quick = MeasuredFigures("cuda:0", rows, 25.0, 6, {"compiled": FormFigures(graph_ms=500.0, graphs=1)})
    assert choose_compile("auto", parameters, rows, steps, 1, measured=quick).compile_new


def test_a_compiled_step_measured_no_faster_than_eager_decodes_eagerly():
    decision = choose_compile("auto", PARAMETERS, ROWS, STEPS, 0, measured=_measured(eager_ms=10.0, fraction=1.2))
    assert (decision.use_compiled, decision.compile_new, decision.saving_ms) == (False, False, 0.0)
    control = choose_compile("auto", PARAMETERS, ROWS, STEPS, 0, measured=_measured(eager_ms=10.0, fraction=0.9))
    assert control.use_compiled and "already compiled" in control.reason


def _captured(new_graphs: int, graph_ms: float = 150.0, fraction: float = 0.3) -> GraphForm:
    return GraphForm("captured", new_graphs, graph_ms, fraction)


@pytest.mark.parametrize(("eager_ms", "captured_ms", "captured_fraction"), list(itertools.product((0.2, 6.0), (50.0, 90_000.0), (0.3, 0.95))))
def test_a_second_graph_form_is_chosen_where_it_nets_the_most(eager_ms, captured_ms, captured_fraction):
    figures = {"compiled": FormFigures(20_000.0, 1, 0.6, 10), "captured": FormFigures(captured_ms, 2, captured_fraction, 10)}
    measured = _measured(eager_ms, forms=figures)
    decision = choose_compile("auto", PARAMETERS, ROWS, STEPS, 2, measured=measured, other_forms=[_captured(4)])
    nets = {"compiled": STEPS * eager_ms * 0.4 - 2 * 20_000.0, "captured": STEPS * eager_ms * (1 - captured_fraction) - 4 * captured_ms}
    best = max(nets, key=nets.get)
    if nets[best] > 0:
        assert (decision.form, decision.use_compiled, decision.compile_new) == (best, True, True)
    else:
        assert (decision.form, decision.compile_new) == ("compiled", False) and "reuse compiled shapes only" in decision.reason
    assert choose_compile(True, PARAMETERS, ROWS, STEPS, 2, measured=measured, other_forms=[_captured(4)]).form == "compiled"


def test_a_second_form_uses_its_prior_until_measured_and_reuses_its_graphs():
    decision = choose_compile("auto", PARAMETERS, ROWS, STEPS, 2, measured=_measured(eager_ms=6.0), other_forms=[_captured(2)])
    assert decision.form == "captured" and decision.compile_new
    assert "captured: 150 ms a graph prior, step 0.3 of eager prior" in decision.reason
    assert decision.saving_ms == pytest.approx(STEPS * 6.0 * 0.7) and decision.compile_ms == pytest.approx(300.0)
    held = choose_compile("auto", PARAMETERS, ROWS, STEPS, 2, measured=_measured(eager_ms=6.0), other_forms=[_captured(0)])
    assert (held.form, held.use_compiled, held.compile_new, held.compile_ms) == ("captured", True, False, 0.0)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_figures_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="eager_step_ms="):
        MeasuredFigures("cuda:0", ROWS, eager_step_ms=bad)
    with pytest.raises(ValueError, match="graph_ms="):
        FormFigures(graph_ms=bad)
    with pytest.raises(ValueError, match="step_fraction="):
        FormFigures(step_fraction=bad)
    with pytest.raises(ValueError, match="captured.graph_ms="):
        GraphForm("captured", 1, bad, 0.5)
    with pytest.raises(ValueError, match="captured.step_fraction="):
        GraphForm("captured", 1, 10.0, bad)
    with pytest.raises(ValueError, match="graph_compile_ms="):
        CompileCosts(graph_compile_ms=bad)
    assert MeasuredFigures("cuda:0", ROWS, eager_step_ms=0.0).eager_step_ms == 0.0  # control: zero is a figure
