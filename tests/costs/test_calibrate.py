"""Calibration: the NNLS fit against known coefficients, refusal of degenerate fits, the calibration
file (round trip, metadata validation, corrupt files), its use by `Rollout`, and the CLI end to end."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from autobucket.cli import main
from autobucket.costs.calibration.measure import CalibrationPlan, Shape, default_plan, quick_plan
from autobucket.costs.calibration_file import (
    SCHEMA_VERSION,
    calibration_metadata,
    load_calibration,
    save_calibration,
)
from autobucket.costs.coefficients import BENCH_QWEN2_GEOMETRY, CostCoefficients, kv_mib, prefill_cost_ms
from autobucket.costs.fit import (
    DECODE_TERMS,
    PREFILL_TERMS,
    DecodePoint,
    PrefillPoint,
    decode_features,
    fit_costs,
    numerical_rank,
    prefill_features,
)

GEOMETRY = BENCH_QWEN2_GEOMETRY
TRUE = CostCoefficients(
    fixed_ms=5.8, token_ms=0.05, attention_ms=10.0, kv_ms=0.3,
    decode_ms=0.0, ordinary_decode_ms=1.5, ordinary_decode_kv_ms=0.2,
)  # fmt: skip
GRID = [Shape(b, w) for b in (1, 4, 16, 32) for w in (4, 16, 64, 128, 256, 512)]
DECODE_GRID = [Shape(32, 16), Shape(8, 128), Shape(32, 128), Shape(8, 512), Shape(32, 512)]


def synthetic_prefill(costs, shapes=GRID, noise=0.01, seed=0, kv_paths=(False, True)):
    """Measurements generated from known coefficients through the fit's own design-matrix code."""
    rng = np.random.default_rng(seed)
    truth = np.array([getattr(costs, name) for name in PREFILL_TERMS])
    points = []
    for shape in shapes:
        for kv_copy in kv_paths:
            exact = float(prefill_features(shape.rows, shape.width, kv_copy, GEOMETRY) @ truth)
            points.append(PrefillPoint(shape.rows, shape.width, kv_copy, exact * (1 + rng.normal(0, noise))))
    return points


def synthetic_decode(costs, shapes=DECODE_GRID, steps=15, noise_ms=0.02, seed=0):
    """CB and ordinary per-step ms whose difference follows `costs` (the CB side carries its KV copy)."""
    rng = np.random.default_rng(seed)
    truth = np.array([getattr(costs, name) for name in DECODE_TERMS])
    points = []
    for shape in shapes:
        ordinary = 5.0 + 0.5 * shape.rows
        probe = DecodePoint(shape.rows, shape.width, steps, 0.0, ordinary)
        difference = float(decode_features(probe, GEOMETRY) @ truth)
        copy = costs.kv_ms * kv_mib(shape.rows, shape.width, GEOMETRY) / steps
        cb = ordinary + difference + copy + rng.normal(0, noise_ms)
        points.append(DecodePoint(shape.rows, shape.width, steps, cb, ordinary))
    return points


# ------------------------------------------------------------------------------------------- the fit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nnls_recovers_known_coefficients(seed):
    # 0.2% noise: the KV copy is ~2% of a prefill row's cost here, identified only by path differences.
    prefill = synthetic_prefill(TRUE, noise=0.002, seed=seed)
    report = fit_costs(prefill, synthetic_decode(TRUE, seed=seed), GEOMETRY)
    assert report.ok, report.problems
    for name in PREFILL_TERMS + DECODE_TERMS:  # the shared step terms only serve predictions
        expected = getattr(TRUE, name)
        got = getattr(report.costs, name)
        assert got == pytest.approx(expected, rel=0.1, abs=0.05), f"{name}: fitted {got}, true {expected}"
    assert report.median_error(holdout=False) < 0.02


def test_decode_fit_recovers_a_cb_step_slower_than_generate():
    truth = CostCoefficients(
        5.0, 0.05, 10.0, 0.3, decode_ms=2.0, ordinary_decode_ms=0.0, ordinary_decode_kv_ms=0.1
    )
    report = fit_costs(synthetic_prefill(truth), synthetic_decode(truth), GEOMETRY)
    assert report.costs.decode_ms == pytest.approx(2.0, abs=0.1)
    assert report.costs.ordinary_decode_ms == pytest.approx(0.0, abs=0.1)
    assert report.costs.ordinary_decode_kv_ms == pytest.approx(0.1, rel=0.1)


@pytest.mark.parametrize("seed", range(8))
def test_fit_never_returns_a_negative_coefficient(seed):
    # Arbitrary (even nonsensical) timings: NNLS must still give coefficients >= 0.
    rng = np.random.default_rng(seed)
    prefill = [
        PrefillPoint(s.rows, s.width, kv, float(rng.uniform(0, 1000))) for s in GRID for kv in (False, True)
    ]
    decode = [
        DecodePoint(s.rows, s.width, 15, float(rng.uniform(0, 50)), float(rng.uniform(1, 50)))
        for s in DECODE_GRID
    ]
    values = fit_costs(prefill, decode, GEOMETRY).costs.to_dict()
    assert all(value >= 0 for value in values.values()), values


def test_fit_report_separates_held_out_shapes():
    held_out = [PrefillPoint(p.rows, p.width + 1, p.kv_copy, p.measured_ms * 1.5, holdout=True)
                for p in synthetic_prefill(TRUE, shapes=[Shape(2, 24), Shape(8, 96)])]  # fmt: skip
    report = fit_costs(synthetic_prefill(TRUE) + held_out, synthetic_decode(TRUE), GEOMETRY)
    assert report.ok
    assert report.costs.fixed_ms == pytest.approx(TRUE.fixed_ms, rel=0.1)  # held-out rows were not fitted
    assert report.median_error(holdout=False) < 0.02
    assert report.median_error(holdout=True) == pytest.approx(1 / 3, abs=0.05)  # predicted ≈ measured / 1.5
    assert report.to_dict()["median_holdout_error"] == report.median_error(holdout=True)


@pytest.mark.parametrize(
    ("prefill", "decode", "expected"),
    [
        (synthetic_prefill(TRUE, shapes=GRID[:1]), synthetic_decode(TRUE), "only 2 prefill measurements"),
        (synthetic_prefill(TRUE, kv_paths=(True,)), synthetic_decode(TRUE), "rank 3 < 4"),
        (synthetic_prefill(TRUE, kv_paths=(False,)), synthetic_decode(TRUE), "rank 3 < 4"),
        (synthetic_prefill(TRUE, shapes=[Shape(4, 64)] * 3), synthetic_decode(TRUE), "rank"),
        (synthetic_prefill(CostCoefficients(0, 0, 0, 0)), synthetic_decode(TRUE), "all prefill coefficients"),
        (synthetic_prefill(TRUE, noise=3.0), synthetic_decode(TRUE), "median relative error"),
        (synthetic_prefill(TRUE), synthetic_decode(TRUE)[:1], "only 1 decode measurements"),
        (synthetic_prefill(TRUE), synthetic_decode(TRUE, shapes=[Shape(8, 64)] * 3), "same KV cache size"),
    ],
    ids=["few-shapes", "kv-path-only", "plain-path-only", "one-shape", "all-zero", "noisy", "one-decode",
         "decode-rank"],
)  # fmt: skip
def test_degenerate_fits_are_refused(prefill, decode, expected):
    report = fit_costs(prefill, decode, GEOMETRY)
    assert not report.ok
    assert any(expected in problem for problem in report.problems), report.problems


def test_rank_ignores_units_but_sees_collinearity():
    design = np.stack([prefill_features(s.rows, s.width, True, GEOMETRY) for s in GRID])
    assert numerical_rank(design) == 3  # B·L and MiB(B, L) are proportional on the KV path alone
    mixed = np.vstack([design, np.stack([prefill_features(s.rows, s.width, False, GEOMETRY) for s in GRID])])
    assert numerical_rank(mixed) == 4


# ------------------------------------------------------------------------------------------- plans
def test_default_plan_covers_the_range_and_holds_out_other_shapes():
    plan = default_plan(max_positions=4096)
    widths = {s.width for s in plan.prefill_shapes}
    assert min(widths) <= 4 and max(widths) == 512
    assert {s.rows for s in plan.prefill_shapes} == {1, 4, 16, 32}
    assert not set(plan.holdout_shapes) & set(plan.prefill_shapes)
    assert len({(s.rows, s.width) for s in plan.decode_shapes}) >= 2
    short = default_plan(max_positions=128)
    assert max(s.width for s in short.prefill_shapes + short.holdout_shapes) + 16 <= 128
    with pytest.raises(ValueError, match="max_length=4096"):
        default_plan(max_positions=2048, max_length=4096)
    with pytest.raises(ValueError, match="repeats"):
        CalibrationPlan((Shape(1, 1),), repeats=0)


@pytest.mark.parametrize("plan", [default_plan(4096), quick_plan(4096), quick_plan(2048)])
def test_built_in_plans_identify_every_coefficient(plan):
    # The synthetic timings are exact, so a refusal could only come from the plan's shapes.
    shapes = list(plan.prefill_shapes)
    report = fit_costs(
        synthetic_prefill(TRUE, shapes, noise=0), synthetic_decode(TRUE, plan.decode_shapes), GEOMETRY
    )
    assert report.ok, report.problems


# ------------------------------------------------------------------------------------------- the file
@pytest.fixture(scope="module")
def model():
    from autobucket.models import build_tiny_model

    return build_tiny_model("tiny-qwen2")


@pytest.fixture
def calibration_path(tmp_path, model):
    path = tmp_path / "costs.json"
    save_calibration(path, TRUE, calibration_metadata(model, "tiny-qwen2"), {"prefill": [], "decode": []})
    return path


def edit_metadata(path, **changes):
    document = json.loads(path.read_text())
    document["metadata"].update(changes)
    path.write_text(json.dumps(document))


def test_round_trip_is_exact_and_silent(calibration_path, model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_calibration(calibration_path, model=model) == TRUE
        assert load_calibration(calibration_path) == TRUE
    document = json.loads(calibration_path.read_text())
    assert document["schema_version"] == SCHEMA_VERSION
    assert document["metadata"]["model"] == "tiny-qwen2" and len(document["metadata"]["config_hash"]) == 64


def test_mismatch_is_refused_naming_every_field(calibration_path, model):
    edit_metadata(calibration_path, dtype="bfloat16", device="NVIDIA H200", config_hash="0" * 64)
    with pytest.raises(ValueError) as error:
        load_calibration(calibration_path, model=model)
    message = str(error.value)
    for expected in ("dtype: file 'bfloat16' vs now 'float32'", "device: file 'NVIDIA H200' vs now 'cpu'",
                     "config_hash: file '000", str(calibration_path), "costs_strict=False) / load_calibration(strict=False) / --allow-mismatch"):  # fmt: skip
        assert expected in message
    assert "attn_implementation" not in message
    with pytest.warns(UserWarning, match="dtype: file 'bfloat16'"):
        assert load_calibration(calibration_path, model=model, strict=False) == TRUE


def test_a_calibration_for_another_model_is_refused(calibration_path, tiny_models):
    with pytest.raises(ValueError, match="config_hash"):
        load_calibration(calibration_path, model=tiny_models("tiny-llama"))


def test_environment_drift_only_warns(calibration_path, model):
    edit_metadata(calibration_path, torch="1.0", source_fingerprint="f" * 64, threads=64)
    with pytest.warns(UserWarning, match="torch: file '1.0'.*source_fingerprint.*threads"):
        assert load_calibration(calibration_path, model=model) == TRUE


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{not json", "is not valid JSON"),
        ("\x00\xff garbage", "not valid JSON"),
        (json.dumps({"schema_version": 99, "costs": {}, "metadata": {}}), "schema_version=99"),
        (json.dumps({"schema_version": SCHEMA_VERSION, "costs": TRUE.to_dict()}), "'metadata' object"),
        (json.dumps({"schema_version": SCHEMA_VERSION, "costs": TRUE.to_dict(), "metadata": {"model": "x"}}),
         "metadata lacks"),
        (json.dumps([1, 2]), "JSON object"),
    ],
)  # fmt: skip
def test_corrupt_files_are_refused_naming_the_path(tmp_path, text, expected):
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=expected) as error:
        load_calibration(path)
    assert str(path) in str(error.value)


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read calibration file"):
        load_calibration(tmp_path / "nope.json")


def test_plain_coefficients_load_with_an_unvalidated_warning(tmp_path, model):
    path = tmp_path / "plain.json"
    path.write_text(json.dumps({"fixed_ms": 3.0, "token_ms": 0.2}))
    with pytest.warns(UserWarning, match="nothing about it could be validated"):
        costs = load_calibration(path, model=model)
    assert costs.fixed_ms == 3.0 and costs.token_ms == 0.2 and costs.decode_ms == CostCoefficients().decode_ms


# ------------------------------------------------------------------------------------------- Rollout
def test_rollout_loads_and_validates_a_calibration(calibration_path, model):
    from autobucket import Rollout, RolloutConfig

    assert Rollout(model, config=RolloutConfig(route="auto", costs=calibration_path)).costs == TRUE
    assert Rollout(model, config=RolloutConfig(route="auto", costs=str(calibration_path))).costs == TRUE
    edit_metadata(calibration_path, attn_implementation="eager")
    with pytest.raises(ValueError, match="attn_implementation: file 'eager' vs now 'sdpa'"):
        Rollout(model, config=RolloutConfig(route="auto", costs=calibration_path))
    with pytest.warns(UserWarning, match="attn_implementation"):
        rollout = Rollout(
            model, config=RolloutConfig(route="auto", costs=calibration_path, costs_strict=False)
        )
    assert rollout.costs == TRUE


def test_a_calibration_is_validated_again_when_the_model_changes_dtype(calibration_path, model):
    """A trainer's `model.to(torch.bfloat16)` after the Rollout was made with an fp32 calibration: the next
    call refuses it as construction would (the model's dtype named), the Rollout stays usable (the call
    after the model is back in fp32 runs), and with costs_strict=False it is a warning."""
    import torch

    from autobucket import Rollout, RolloutConfig, SamplingConfig
    from autobucket.models import build_tiny_model

    own = build_tiny_model("tiny-qwen2")  # the fixture's model is shared: this one changes dtype
    prompts, sampling = [[5, 6, 7, 8]] * 2, SamplingConfig(max_new_tokens=2)
    rollout = Rollout(own, config=RolloutConfig(route="auto", costs=calibration_path))
    before = rollout.generate(prompts, sampling).tokens
    own.to(torch.bfloat16)
    for _ in range(2):  # refused at every call while the model differs, not only the first
        with pytest.raises(ValueError, match="dtype: file 'float32' vs now 'bfloat16'"):
            rollout.generate(prompts, sampling)
    own.to(torch.float32)
    assert rollout.generate(prompts, sampling).tokens == before
    lenient = Rollout(own, config=RolloutConfig(route="auto", costs=calibration_path, costs_strict=False))
    own.to(torch.bfloat16)
    with pytest.warns(UserWarning, match="dtype: file 'float32' vs now 'bfloat16'"):
        lenient.generate(prompts, sampling)
    assert lenient.costs == TRUE and lenient.geometry.element_bytes == 2


def test_costs_strict_must_be_a_bool():
    from autobucket import RolloutConfig

    with pytest.raises(ValueError, match="costs_strict='no'"):
        RolloutConfig(costs_strict="no")


# ------------------------------------------------------------------------------------------- the CLI
def test_calibrate_cli_end_to_end_writes_a_loadable_file(tmp_path, model, capsys):
    out = tmp_path / "cal.json"
    argv = ["calibrate", "--model", "tiny-qwen2", "--out", str(out), "--shapes", "1:8,1:48,4:8,4:48,8:24",
            "--holdout-shapes", "2:16,6:32", "--decode-shapes", "2:8,6:40", "--decode-new-tokens", "4",
            "--repeats", "2", "--max-error", "1000", "--max-holdout-error", "1000"]  # fmt: skip
    # A shared 2-core machine can be arbitrarily noisy: --max-error keeps this a test of the pipeline.
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Fit report" in printed and "held out" in printed and "saved" in printed
    document = json.loads(out.read_text())
    assert len(document["measurements"]["prefill"]) == 7 and len(document["measurements"]["decode"]) == 2
    assert all(
        len(item["plain_ms"]) == 2 == len(item["kv_copy_ms"]) for item in document["measurements"]["prefill"]
    )
    assert document["fit"]["median_holdout_error"] is not None
    assert document["plan"]["holdout_shapes"] == ["2:16", "6:32"]
    assert document["metadata"]["model"] == "tiny-qwen2"
    costs = load_calibration(out, model=model)
    assert costs.to_dict() == document["costs"]


def test_calibrate_cli_refuses_a_degenerate_fit(tmp_path, capsys):
    out = tmp_path / "cal.json"
    argv = ["calibrate", "--model", "tiny-qwen2", "--out", str(out), "--shapes", "1:8,2:8", "--no-holdout",
            "--decode-shapes", "2:8", "--decode-new-tokens", "2", "--repeats", "1"]  # fmt: skip
    assert main(argv) == 1
    assert "fit refused, nothing saved" in capsys.readouterr().err
    assert not out.exists()


def test_calibrate_cli_rejects_a_bad_shape(capsys):
    assert main(["calibrate", "--model", "tiny-qwen2", "--shapes", "8x16"]) == 2
    assert "expected B:L" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- measuring
def test_calibration_times_the_engines_own_prefill_and_insert(model, monkeypatch):
    from autobucket.costs.calibration.measure import measure
    from autobucket.engine.batching.model_runner import ModelRunner

    calls = {"prefill": 0, "insert": 0}
    for name in calls:
        original = getattr(ModelRunner, name)

        def counted(self, *args, _name=name, _original=original):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(ModelRunner, name, counted)
    plan = CalibrationPlan((Shape(1, 8), Shape(2, 16)), (Shape(3, 4),), (), repeats=2, warmup=0)
    measurements = measure(model, plan, lambda description: None)
    # 3 shapes x 2 repeats: one prefill and two inserts each (the first allocates, the second is timed).
    assert calls == {"prefill": 6, "insert": 12}
    assert all(len(item["insert_ms"]) == 2 for item in measurements["prefill"])


def test_measuring_stops_at_the_deadline_and_the_refusal_names_the_shapes(model):
    from autobucket.costs.calibration.measure import calibrate

    plan = CalibrationPlan((Shape(1, 8), Shape(4, 8), Shape(1, 32), Shape(4, 32)), (Shape(2, 16),),
                           (Shape(2, 8), Shape(4, 16)), decode_new_tokens=3, repeats=50, warmup=0,
                           max_seconds=1e-9)  # fmt: skip
    result = calibrate(model, plan)
    assert result.measurements["rounds"] == 0 and not result.report.ok
    refusal = next(p for p in result.report.problems if "measured only" in p)
    assert "measured only 0 of 7 shapes" in refusal and "prefill 4:32" in refusal and "--quick" in refusal
    # Stopped at the deadline: nothing was measured, where 50 rounds were asked for.
    assert not any(item["plain_ms"] for item in result.measurements["prefill"])


def test_outlier_rejection_drops_a_slowed_sample_but_keeps_honest_spread():
    from autobucket.costs.calibration.timing import inliers, robust_median, spread

    assert inliers([10.0, 10.2, 9.9, 10.1, 60.0]) == [10.0, 10.2, 9.9, 10.1]
    assert robust_median([10.0, 10.2, 9.9, 10.1, 60.0]) == pytest.approx(10.05)
    assert inliers([10.0, 14.0, 20.0]) == [10.0, 14.0, 20.0]  # spread, not outliers
    assert spread([10.0, 10.0, 10.0]) == 0.0 and spread([5.0, 10.0, 20.0]) > 0.25


@pytest.mark.parametrize("forward_sq_ms", [0.0, 2.0])
def test_the_super_linear_term_is_kept_only_when_held_out_shapes_need_it(forward_sq_ms):
    from dataclasses import replace

    truth = replace(TRUE, forward_sq_ms=forward_sq_ms)
    fitted = [PrefillPoint(p.rows, p.width, p.kv_copy, p.measured_ms + forward_sq_ms * (p.rows * p.width / 1e3) ** 2)
              for p in synthetic_prefill(TRUE, noise=0.01)]  # fmt: skip
    held_out = [PrefillPoint(rows, width, kv, prefill_cost_ms(rows, width, GEOMETRY, truth, kv), holdout=True)
                for rows, width in ((2, 384), (8, 96), (24, 300), (12, 512)) for kv in (False, True)]  # fmt: skip
    report = fit_costs(fitted + held_out, synthetic_decode(TRUE), GEOMETRY)
    if forward_sq_ms:
        assert report.costs.forward_sq_ms == pytest.approx(forward_sq_ms, rel=0.2)
        assert report.median_error(holdout=True) < 0.05
    else:
        assert report.costs.forward_sq_ms == 0.0  # the reference's special case
