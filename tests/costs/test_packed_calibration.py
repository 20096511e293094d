"""Calibration of the packed form's per-prompt cost (`packed_prompt_ms`): the fit against synthetic
timings of known coefficients, the engine's own packed prefill being what is timed, the calibration file
carrying the value (old files loading the default), and the value reaching the planner's choice."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from autobucket.cli import main
from autobucket.costs.calibration.measure import CalibrationPlan, Shape, quick_plan
from autobucket.costs.calibration_file import calibration_metadata, load_calibration, save_calibration
from autobucket.costs.coefficients import BENCH_QWEN2_GEOMETRY, CostCoefficients, prefill_cost_ms
from autobucket.costs.fit import PrefillPoint, fit_costs
from autobucket.costs.packed_fit import PackedPoint, fit_packed_prompt_ms
from autobucket.planning.forms import DENSE, PACKED, PADDED, SEGMENTS, FormCosts, packed_cost_ms

GEOMETRY = BENCH_QWEN2_GEOMETRY
# bench-qwen2's calibrated padded coefficients (docs/benchmarks.md), with a per-prompt cost to recover
TRUE = CostCoefficients(fixed_ms=5.741, token_ms=0.1037, attention_ms=12.70, kv_ms=0.1182, packed_prompt_ms=0.8)
GRID = [Shape(b, w) for b in (1, 4, 16, 32) for w in (4, 16, 64, 128, 256, 512)]
PACKED_GRID = [Shape(b, w) for b in (2, 4, 16) for w in (8, 32, 128) if b * w <= 2048]


def synthetic(costs, attention=SEGMENTS, noise=0.01, seed=0, packed_shapes=PACKED_GRID):
    """Prefill (both paths) and packed timings generated from `costs` by the planner's own cost functions."""
    rng = np.random.default_rng(seed)
    prefill = [PrefillPoint(s.rows, s.width, kv, prefill_cost_ms(s.rows, s.width, GEOMETRY, costs, kv)
                            * (1 + rng.normal(0, noise))) for s in GRID for kv in (False, True)]  # fmt: skip
    packed = [PackedPoint(s.rows, s.width, attention, (1 + rng.normal(0, noise))
                          * packed_cost_ms([s.width] * s.rows, GEOMETRY, costs, FormCosts.of(costs), attention))
              for s in packed_shapes]  # fmt: skip
    return prefill, packed


@pytest.mark.parametrize("attention", [SEGMENTS, DENSE])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fit_recovers_a_known_packed_prompt_ms(attention, seed):
    prefill, packed = synthetic(TRUE, attention, seed=seed)
    report = fit_costs(prefill, [], GEOMETRY, packed=packed)
    assert report.costs.packed_prompt_ms == pytest.approx(TRUE.packed_prompt_ms, rel=0.25)
    exact_prefill, exact_packed = synthetic(TRUE, attention, noise=0.0)
    exact = fit_costs(exact_prefill, [], GEOMETRY, packed=exact_packed)
    assert exact.costs.packed_prompt_ms == pytest.approx(TRUE.packed_prompt_ms, rel=1e-6)
    assert sum(row.kind == "packed" for row in report.rows) == len(packed)


def test_without_packed_timings_the_default_stays():
    prefill, _ = synthetic(TRUE)
    assert fit_costs(prefill, [], GEOMETRY).costs.packed_prompt_ms == CostCoefficients().packed_prompt_ms == 0.3
    # Negative control: the same prefill timings with packed ones whose per-prompt cost is 0 move it to ~0.
    _, free = synthetic(replace(TRUE, packed_prompt_ms=0.0), noise=0.0)
    assert fit_costs(prefill, [], GEOMETRY, packed=free).costs.packed_prompt_ms < 0.05


def test_packed_forwards_faster_than_the_model_fit_zero_never_negative():
    _, packed = synthetic(TRUE, noise=0.0)
    faster = [replace(p, measured_ms=0.5 * p.measured_ms) for p in packed]
    assert fit_packed_prompt_ms(faster, GEOMETRY, TRUE) == 0.0
    with pytest.raises(ValueError, match="attention='flex'"):
        PackedPoint(2, 8, "flex", 1.0)


# ------------------------------------------------------------------ measuring on a tiny model
@pytest.fixture(scope="module")
def model():
    from autobucket.models import build_tiny_model

    return build_tiny_model("tiny-qwen2")


def test_calibration_times_packed_forwards_through_the_engines_prefill(model, monkeypatch):
    from autobucket.costs.calibration.measure import measure
    from autobucket.engine.batching.model_runner import ModelRunner

    forms = []
    original = ModelRunner.prefill

    def recorded(self, prompts, form=PADDED, chunk_tokens=None):
        forms.append((form, len(prompts)))
        return original(self, prompts, form, chunk_tokens)

    monkeypatch.setattr(ModelRunner, "prefill", recorded)
    plan = CalibrationPlan((Shape(1, 8),), (), (), repeats=2, warmup=0, packed_shapes=(Shape(3, 8), Shape(2, 16)))
    measurements = measure(model, plan, lambda description: None)
    assert sorted(forms) == sorted([(PADDED, 1)] * 2 + [(PACKED, 3)] * 2 + [(PACKED, 2)] * 2)
    assert sorted((item["rows"], item["width"], item["attention"]) for item in measurements["packed"]) == [
        (2, 16, SEGMENTS), (3, 8, SEGMENTS)]  # fmt: skip
    assert all(len(item["kv_copy_ms"]) == 2 for item in measurements["packed"])


def test_built_in_plans_pack_and_stay_within_the_packed_row_bound():
    plan = quick_plan(4096)
    assert plan.packed_shapes and all(s.rows >= 2 and s.rows * s.width <= 2048 for s in plan.packed_shapes)
    assert plan.to_dict()["packed_shapes"] == [str(s) for s in plan.packed_shapes]


def test_calibrate_cli_writes_packed_prompt_ms_and_load_returns_it(tmp_path, model):
    out = tmp_path / "cal.json"
    argv = ["calibrate", "--model", "tiny-qwen2", "--out", str(out), "--shapes", "1:8,1:48,4:8,4:48,8:24",
            "--holdout-shapes", "2:16", "--decode-shapes", "2:8,6:40", "--decode-new-tokens", "3",
            "--packed-shapes", "2:8,4:24", "--repeats", "2", "--max-error", "1000", "--max-holdout-error", "1000"]  # fmt: skip
    assert main(argv) == 0  # --max-error: a noisy shared machine must not make this a test of its load
    document = json.loads(out.read_text())
    assert sorted((i["rows"], i["width"]) for i in document["measurements"]["packed"]) == [(2, 8), (4, 24)]
    assert document["plan"]["packed_shapes"] == ["2:8", "4:24"]
    fitted = document["costs"]["packed_prompt_ms"]
    assert load_calibration(out, model=model).packed_prompt_ms == fitted
    # It is the fit of what was measured: refitting the saved measurements gives the same value.
    from autobucket.costs.calibration.measure import fit_measurements, model_geometry

    assert fit_measurements(document["measurements"], model_geometry(model)).costs.packed_prompt_ms == fitted


def test_an_old_calibration_without_the_field_loads_the_default(tmp_path, model):
    path = tmp_path / "old.json"
    save_calibration(path, TRUE, calibration_metadata(model, "tiny-qwen2"), {"prefill": [], "decode": []})
    document = json.loads(path.read_text())
    del document["costs"]["packed_prompt_ms"]
    path.write_text(json.dumps(document))
    assert load_calibration(path, model=model) == replace(TRUE, packed_prompt_ms=0.3)
    assert load_calibration(path, model=model).packed_prompt_ms == FormCosts().packed_prompt_ms


# ------------------------------------------------------------------ the planner reads it
@pytest.mark.parametrize("packed_prompt_ms, form", [(0.0, PACKED), (100.0, PADDED)])
def test_a_calibration_file_changes_the_engines_packed_or_padded_choice(tmp_path, model, packed_prompt_ms, form):
    from autobucket import Rollout, RolloutConfig, SamplingConfig

    # One forward either way (fixed_ms dominates); padding [12, 9, 6, 3] to 12 runs 18 more tokens at 1 ms
    # each, packing costs packed_prompt_ms per prompt: 0 -> packed, 100 -> padded.
    costs = CostCoefficients(fixed_ms=1000.0, token_ms=1.0, attention_ms=0.0, kv_ms=0.0, decode_ms=0.0,
                             packed_prompt_ms=packed_prompt_ms)  # fmt: skip
    path = tmp_path / "costs.json"
    save_calibration(path, costs, calibration_metadata(model, "tiny-qwen2"))
    rollout = Rollout(model, config=RolloutConfig(route="bucketed", costs=str(path), profile=True))
    prompts = [[5 + i for i in range(n)] for n in (12, 9, 6, 3)]
    result = rollout.generate(prompts, SamplingConfig(max_new_tokens=2, eos_token_id=[]))
    assert result.profile.prefill_forms == [[form]]
