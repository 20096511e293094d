"""Online cost learning: convergence from wrong priors on synthetic timings with noise and outliers (with a
negative control: the same stream without the outlier guard must fail), one noisy call cannot swing the
coefficients, the per-fingerprint cache entry (round trip, corrupt or mismatched entries ignored with a
notice), and the profile's predicted vs measured fields on a real model."""

from __future__ import annotations

import json
import random

import pytest
import torch

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs import source as cost_source
from autobucket.costs.coefficients import (
    BENCH_QWEN2_GEOMETRY,
    CB_STEP,
    KV_COPY,
    ORDINARY_STEP,
    PREFILL_FORWARD,
    CostCoefficients,
    timing_ms,
)
from autobucket.costs.online import OnlineCosts, median_relative_error
from autobucket.costs.store import entry_path, load_entry, save_entry, store_metadata
from autobucket.models import CACHE_DIR_ENV, build_tiny_model
from autobucket.planning.route_choice import choose_route
from autobucket.profile import Profile, Timing
from autobucket.prompts import random_prompts

GEOMETRY = BENCH_QWEN2_GEOMETRY
# CPU-like truth (ENVIRONMENT.md's 20.3M fit plus decode terms): padding is expensive, a forward is cheap.
TRUE = CostCoefficients(
    fixed_ms=5.8, token_ms=0.0537, attention_ms=40.0, kv_ms=0.3, decode_ms=0.0, ordinary_decode_ms=1.5,
    ordinary_decode_kv_ms=0.2, step_ms=3.0, step_row_ms=0.6, step_kv_ms=0.05,
)  # fmt: skip
# Deliberately wrong: the reference's GPU defaults (a forward costs 25 ms, a CB step 10 ms more).
WRONG = CostCoefficients()
PREFILL_SHAPES = [(1, 16), (4, 64), (8, 128), (16, 256), (32, 512)]
STEP_SHAPES = [(4, 64), (8, 256), (16, 600), (32, 300)]  # within the decode shapes the stream holds
TOLERANCE = 0.15  # worst relative error of the learned model's predictions over the checked shapes
WORKLOADS = [[16] * 31 + [512], [64] * 8, [8, 100, 300, 40, 12, 500, 77, 3], [256] * 32]


def synthetic_call(rng: random.Random, slow: float, spike: bool, truth: CostCoefficients = TRUE) -> list[Timing]:
    """One call's timings from TRUE: a few prefill buckets with their KV copies and 15 decode steps of
    one route, 5% log-normal noise, every timing × `slow` (a competing job), one timing ×20 if `spike`."""
    timings = []
    for _ in range(rng.randint(1, 4)):
        rows, width = rng.choice([1, 2, 4, 8, 16, 32]), rng.choice([8, 16, 32, 64, 128, 256, 512])
        timings += [Timing(PREFILL_FORWARD, rows, width, 0.0), Timing(KV_COPY, rows, width, 0.0)]
    kind, rows, width = rng.choice([CB_STEP, ORDINARY_STEP]), rng.choice([4, 8, 16, 32]), rng.choice([64, 256, 600])
    timings += [Timing(kind, rows, width + step, 0.0) for step in range(15)]
    measured = [Timing(t.kind, t.rows, t.width,
                       timing_ms(t.kind, t.rows, t.width, GEOMETRY, truth) * slow * rng.lognormvariate(0, 0.05))
                for t in timings]  # fmt: skip
    if spike:
        index = rng.randrange(len(measured))
        measured[index] = Timing(*list(vars_of(measured[index]))[:3], measured[index].ms * 20)
    return measured


def vars_of(timing: Timing) -> tuple:
    return (timing.kind, timing.rows, timing.width, timing.ms)


def learn(prior: CostCoefficients, robust: bool, calls: int = 24, seed: int = 0, truth=TRUE) -> OnlineCosts:
    rng = random.Random(seed)
    learner = OnlineCosts(prior, GEOMETRY, robust=robust)
    for call in range(calls):
        # Every third call runs while another job halves the machine (3x slower); every fifth has a spike.
        learner.observe(synthetic_call(rng, slow=3.0 if call % 3 == 2 else 1.0, spike=call % 5 == 4, truth=truth))
    return learner


def worst_error(costs: CostCoefficients) -> float:
    errors = []
    for kinds, shapes in (((PREFILL_FORWARD, KV_COPY), PREFILL_SHAPES), ((CB_STEP, ORDINARY_STEP), STEP_SHAPES)):
        for kind, (rows, width) in ((kind, shape) for kind in kinds for shape in shapes):
            truth = timing_ms(kind, rows, width, GEOMETRY, TRUE)
            errors.append(abs(timing_ms(kind, rows, width, GEOMETRY, costs) - truth) / truth)
    return max(errors)


def decisions(costs: CostCoefficients) -> list[str]:
    return [choose_route(lengths, 16, 32, GEOMETRY, costs).route for lengths in WORKLOADS]


@pytest.mark.parametrize("prior", [WRONG, CostCoefficients(**{k: v * 10 for k, v in TRUE.to_dict().items()})])
@pytest.mark.parametrize("seed", [0, 1])
def test_learning_converges_from_a_wrong_prior_despite_noise_and_outliers(prior, seed):
    learner = learn(prior, robust=True, seed=seed)
    assert worst_error(prior) > 0.5  # the prior really is wrong
    assert worst_error(learner.costs) < TOLERANCE, learner.costs
    assert decisions(learner.costs) == decisions(TRUE)


@pytest.mark.parametrize("seed", [0, 1])
def test_negative_control_without_the_outlier_guard_learning_fails(seed):
    learner = learn(WRONG, robust=False, seed=seed)
    # The same stream and the same check as the convergence test above: only the guard differs.
    assert worst_error(learner.costs) > TOLERANCE, "the guard-free fit should be pulled off by the slow calls"


@pytest.mark.parametrize("forward_sq_ms", [0.0, 3.0])
def test_the_super_linear_term_is_learned_only_when_held_out_timings_need_it(forward_sq_ms):
    from dataclasses import replace

    learner = learn(WRONG, robust=True, calls=30, truth=replace(TRUE, forward_sq_ms=forward_sq_ms))
    if forward_sq_ms:
        assert learner.costs.forward_sq_ms == pytest.approx(forward_sq_ms, rel=0.3)
    else:
        assert learner.costs.forward_sq_ms == 0.0


def test_one_noisy_call_cannot_swing_the_coefficients():
    learner = learn(WRONG, robust=True)
    before = learner.costs
    rng = random.Random(7)
    learner.observe(synthetic_call(rng, slow=10.0, spike=True))  # everything 10x slower, once
    for name, value in before.to_dict().items():
        assert getattr(learner.costs, name) == pytest.approx(value, rel=0.1, abs=1e-3), name


def test_an_update_that_predicts_worse_is_not_taken():
    learner = OnlineCosts(TRUE, GEOMETRY)
    rng = random.Random(3)
    learner.observe(synthetic_call(rng, 1.0, False))
    good = learner.costs
    window = learner.observations()
    # Only outliers arrive: whatever the refit, the coefficients in use must not predict the window worse.
    learner.observe([Timing(t.kind, t.rows, t.width, t.ms * 50) for t in window[:3]])
    assert median_relative_error(window, GEOMETRY, learner.costs) <= median_relative_error(window, GEOMETRY, good) + 1e-9


# ------------------------------------------------------------------------------------ the cache entry
@pytest.fixture
def metadata(tiny_models, tmp_path, monkeypatch):
    # A cache of its own: a corrupted entry must not reach later tests that learn on the same model.
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    return store_metadata(tiny_models("tiny-qwen2"))


def test_entry_round_trip_is_exact(metadata):
    observations = [Timing(PREFILL_FORWARD, 4, 64, 12.5), Timing(CB_STEP, 8, 300, 3.25)]
    path = save_entry(metadata, TRUE, observations, "online")
    assert path.parent.parent == entry_path(metadata).parent.parent and not list(path.parent.glob(".*tmp"))
    assert load_entry(metadata) == (TRUE, observations, "online")


@pytest.mark.parametrize(
    "corrupt, expected",
    [
        (lambda path: path.write_text("{not json"), "Expecting property name"),
        (lambda path: path.write_text(json.dumps({"schema_version": 99})), "schema_version"),
        (lambda path: _edit(path, lambda d: d["metadata"].update(threads=97)), "threads 97"),
        (lambda path: _edit(path, lambda d: d["metadata"].update(config_hash="other")), "config_hash 'other'"),
        (lambda path: _edit(path, lambda d: d["costs"].update(fixed_ms=-1)), "fixed_ms=-1"),
    ],
)
def test_corrupt_or_mismatched_entries_are_ignored_with_a_notice(metadata, corrupt, expected):
    path = save_entry(metadata, TRUE, [], "online")
    corrupt(path)
    with pytest.warns(UserWarning, match=expected) as notices:
        assert load_entry(metadata) is None
    assert len(notices) == 1 and "\n" not in str(notices[0].message)


def _edit(path, change) -> None:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


# ------------------------------------------------------------------------------------ through Rollout
@pytest.mark.usefixtures("single_thread")
def test_rollout_learns_persists_and_reports_predicted_vs_measured(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))  # a fresh cache: the first call probes
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([5, 40, 7, 100, 12, 3], 1024, seed=0)
    sampling = SamplingConfig(max_new_tokens=5, continuous_batch_size=4)
    first = Rollout(model, config=RolloutConfig(route="auto"))
    profiles = [first.generate(prompts, sampling).profile for _ in range(2)]
    assert [p.costs_source for p in profiles] == ["probe", "online"]
    for profile in profiles:
        assert profile.measured_ms == pytest.approx(sum(t.ms for t in profile.timings))
        assert profile.predicted_ms > 0 and set(profile.costs) == set(CostCoefficients().to_dict())
        assert "timings" not in profile.to_dict()
        # No timing measures the packed per-prompt cost: the probe's zero prior keeps its default.
        assert profile.costs["packed_prompt_ms"] == CostCoefficients().packed_prompt_ms
    second = Rollout(model, config=RolloutConfig(route="auto"))
    assert second.costs == first.costs and second.cost_source.source == "stored"


@pytest.mark.parametrize("share, refits", [(0.02, 4), (1e9, 20)])
def test_refits_take_at_most_their_share_of_generate_time(tiny_models, tmp_path, monkeypatch, share, refits):
    # A clock the refits advance: each takes 10 ms, each call measures 100 ms. At a 2% share a refit needs
    # 500 ms of calls since the last one: calls 5, 10, 15 and 20 refit. 1e9 is the control: every call.
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    rollout = Rollout(tiny_models("tiny-qwen2"), config=RolloutConfig(route="auto"))
    rollout.generate(random_prompts([5, 40, 7], 1024, seed=1), SamplingConfig(max_new_tokens=3))  # the probe
    source = rollout.cost_source
    clock, done = [0.0], []

    def refit(self):
        clock[0] += 0.010
        done.append(clock[0])

    monkeypatch.setattr(cost_source, "REFIT_SHARE", share)
    monkeypatch.setattr(cost_source.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(OnlineCosts, "refit", refit)
    source._refit_ms, source._since_refit_ms = 10.0, 0.0
    window = []
    for call in range(20):
        profile = Profile(timings=[Timing(PREFILL_FORWARD, 2, 64 + call, 100.0)])
        source.after_call(profile, None)
        window.append(len(source.learner.observations()))
    assert len(done) == refits
    assert window == sorted(window) and window[-1] > window[0]  # every call's timings joined the window
    assert source.source == "online"


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("route", ["ordinary", "equal_width"])
def test_every_route_records_its_forwards_and_steps(tiny_models, route):
    model = tiny_models("tiny-llama")
    prompts = random_prompts([5, 40, 7], 1024, seed=1)
    config = RolloutConfig(route=route, costs=CostCoefficients())
    profile = Rollout(model, config=config).generate(prompts, SamplingConfig(max_new_tokens=6, eos_token_id=[])).profile
    kinds = [t.kind for t in profile.timings]
    step = ORDINARY_STEP if route == "ordinary" else CB_STEP
    assert kinds.count(PREFILL_FORWARD) == profile.prefill_forwards == 1
    assert kinds.count(step) == profile.decode_forwards == 5
    widths = [t.width for t in profile.timings if t.kind == step]
    assert widths == [41 + k for k in range(5)]  # the prompt width plus each step's fed-back tokens
    assert profile.costs_source == "defaults"


# ------------------------------------------------------------------------------------ the CLI
def test_sweep_cli_online_writes_the_learning_curve(tmp_path, capsys, monkeypatch):
    from autobucket.cli.main import (
        main,  # (the package's `main` name is shadowed once this module is imported)
    )

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))  # a fresh cache: the first call probes
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["sweep", "--model", "tiny-qwen2", "--costs", "online", "--workloads", "none", "--lengths", "40,3x6",
            "--repeats", "2", "--max-new-tokens", "4", "--no-hf-batch", "--out", str(out), "--plot", str(plot)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    curve = report["learning_curve"]
    assert report["costs"] == "online" and len(curve) == 3  # one warm-up and two timed Auto calls
    assert [point["source"] for point in curve] == ["probe", "online", "online"]
    assert all(point["predicted_ms"] > 0 and point["measured_ms"] > 0 for point in curve)
    assert report["workloads"][0]["tokens_match_all"]
    learning = tmp_path / "sweep-learning.png"
    assert learning.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {learning}" in capsys.readouterr().out


def test_generate_summary_says_when_the_coefficients_are_the_defaults():
    from autobucket.cli.generate import cost_model_line

    line = cost_model_line({"costs_source": "defaults", "predicted_ms": 25.8, "measured_ms": 2824.0})
    assert "predicted 26 ms vs measured 2824 ms" in line and "built-in reference (GPU) defaults" in line
    assert "learned from earlier calls" in cost_model_line({"costs_source": "online", "predicted_ms": 1.0, "measured_ms": 1.0})


def test_the_ray_driver_takes_the_median_of_what_online_workers_learned():
    from types import SimpleNamespace

    from autobucket.distributed.ray_rollout import _learned_costs

    def result(source, fixed_ms):
        return SimpleNamespace(profile=SimpleNamespace(costs_source=source, costs=TRUE.to_dict() | {"fixed_ms": fixed_ms}))

    learned = _learned_costs([result("online", 1.0), result("stored", 3.0), result("online", 8.0), result("file", 99.0)])
    assert learned.fixed_ms == 3.0 and learned.token_ms == TRUE.token_ms  # the file-pinned worker does not vote
    assert _learned_costs([result("given", 1.0)]) is None


@pytest.mark.usefixtures("single_thread")
def test_costs_follow_the_model_to_another_dtype_and_back(tiny_models, tmp_path, monkeypatch):
    """A trainer's `model.to(torch.bfloat16)` between calls: the bf16 calls learn bf16 costs (their own
    probe, no fp32 timing in their window, KV bytes of 2), saved as their own entry; back in fp32 the fp32
    learning continues where it stopped (no probe). Control: a Rollout that does not follow plans the
    bf16 calls with the fp32 learner, whose window then mixes both dtypes."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    model = build_tiny_model("tiny-qwen2", seed=4)
    prompts = random_prompts([5, 40, 7, 100, 12, 3], 1024, seed=0)
    sampling = SamplingConfig(max_new_tokens=5, continuous_batch_size=4)
    probes, real_probe = [], cost_source.probe
    monkeypatch.setattr(cost_source, "probe", lambda *args: probes.append(1) or real_probe(*args))
    rollout = Rollout(model, config=RolloutConfig(route="auto"))
    fp32_call = rollout.generate(prompts, sampling).profile
    fp32_learner = rollout.cost_source.learner
    fp32_window = len(fp32_learner.observations())
    model.to(torch.bfloat16)
    bf16_calls = [rollout.generate(prompts, sampling).profile for _ in range(2)]
    assert [p.costs_source for p in (fp32_call, *bf16_calls)] == ["probe", "probe", "online"] and len(probes) == 2
    assert rollout.cost_source.learner is not fp32_learner and rollout.geometry.element_bytes == 2
    assert len(fp32_learner.observations()) == fp32_window  # no bf16 timing joined the fp32 window
    entries = [json.loads(path.read_text())["metadata"]["dtype"] for path in (tmp_path / "online-costs").glob("*.json")]
    assert sorted(entries) == ["bfloat16", "float32"]
    model.to(torch.float32)
    back = rollout.generate(prompts, sampling).profile
    assert back.costs_source == "online" and len(probes) == 2 and rollout.cost_source.learner is fp32_learner
    assert rollout.geometry.element_bytes == 4


@pytest.mark.usefixtures("single_thread")
def test_control_without_following_the_bf16_calls_plan_with_the_fp32_costs(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(Rollout, "_follow_model", lambda self: None)
    model = build_tiny_model("tiny-qwen2", seed=4)
    prompts = random_prompts([5, 40, 7, 100, 12, 3], 1024, seed=0)
    sampling = SamplingConfig(max_new_tokens=5, continuous_batch_size=4)
    rollout = Rollout(model, config=RolloutConfig(route="auto"))
    rollout.generate(prompts, sampling)
    fp32_learner = rollout.cost_source.learner
    fp32_window = len(fp32_learner.observations())
    model.to(torch.bfloat16)
    assert rollout.generate(prompts, sampling).profile.costs_source == "online"  # no bf16 probe
    assert rollout.cost_source.learner is fp32_learner and rollout.geometry.element_bytes == 4
    assert len(fp32_learner.observations()) > fp32_window  # bf16 timings in the fp32 window
