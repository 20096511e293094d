"""The in-process contract: a `generate` call leaves the trainer's model exactly as found, and other
threads' forwards of the same model are unaffected while it runs.

A prober thread runs a forward of the same model in a loop while the main thread runs `generate` on each
route (packed prefill, chunked prefill, the compiled decode step, ordinary `generate`). Its oracle is a
forward computed before any engine call: every output must equal it bit for bit, and the model's state
(config, attention implementation, hooks, training flags, parameters, buffers) and the global torch RNG
state must equal the snapshot taken before, at every iteration, and after the calls.

Negative controls run the same probe against deliberately mutating variants of the engine — today's
config swap around a packed forward, and forward hooks registered around ordinary `generate` — and
must see them."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch
from oracles import assert_matches_oracle, oracle_batch
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.engine import ordinary
from autobucket.engine.batching import packed_prefill
from autobucket.models import build_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_thread")]

LENGTHS = (5, 17, 30, 3, 9, 40, 12, 26)
BUDGET = 6
PACK_EVERYTHING = CostCoefficients(fixed_ms=1e4)  # the planner packs each admission into few forwards

ROUTE_CONFIGS = {
    "packed": dict(route="bucketed", costs=PACK_EVERYTHING),
    "chunked": dict(route="aligned", prefill_max_tokens=8),
    "ordinary": dict(route="ordinary"),
    "auto": dict(route="auto", costs=CostCoefficients()),
    "invariant_kernels": dict(route="bucketed", costs=PACK_EVERYTHING, kernels="invariant"),
}


def model_state(model: torch.nn.Module) -> dict:
    """Everything a call could change on the model that another thread's forward would see."""
    modules = {
        name: (
            module.training,
            len(module._forward_hooks), len(module._forward_pre_hooks), len(module._backward_hooks),
            len(module._backward_pre_hooks), len(module._state_dict_hooks), len(module._load_state_dict_pre_hooks),
            sorted(k for k in vars(module) if not k.startswith("_")),
        )  # fmt: skip
        for name, module in model.named_modules()
    }
    tensors = {
        name: (t.data_ptr(), t._version, t.requires_grad, t.dtype)
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }
    config = model.config
    return {
        "config": config.to_dict(),
        "attn_implementation": config._attn_implementation,
        "generation_config": model.generation_config.to_dict(),
        "modules": modules,
        "tensors": tensors,
        "global_hooks": len(torch.nn.modules.module._global_forward_hooks),
    }


class Prober(threading.Thread):
    """Forwards of `model` in a loop; records every output that differs from the reference, every state
    change and every exception, and how many iterations overlapped the main thread's `generate`."""

    def __init__(self, model: torch.nn.Module, generating: threading.Event) -> None:
        super().__init__(daemon=True)
        self.model, self.generating = model, generating
        self.ids = torch.tensor([random_prompts([24], seed=99)[0]])
        with torch.inference_mode():
            self.reference = model(input_ids=self.ids).logits
        self.state, self.rng = model_state(model), torch.get_rng_state()
        self.stop, self.failures, self.overlapped = threading.Event(), [], 0

    def run(self) -> None:
        torch.set_num_threads(1)
        while not self.stop.is_set():
            during = self.generating.is_set()
            try:
                with torch.inference_mode():
                    logits = self.model(input_ids=self.ids).logits
                if not torch.equal(logits, self.reference):
                    self.failures.append(f"logits differ by {(logits - self.reference).abs().max().item():.3g}")
                if model_state(self.model) != self.state:
                    self.failures.append("model state changed")
                if not torch.equal(torch.get_rng_state(), self.rng):
                    self.failures.append("global torch RNG state changed")
            except Exception as error:  # noqa: BLE001 - what a trainer's thread would see; reported below
                self.failures.append(f"{type(error).__name__}: {error}")
            self.overlapped += during and self.generating.is_set()


@contextmanager
def probing(model):
    generating = threading.Event()
    prober = Prober(model, generating)
    prober.start()
    try:
        yield prober, generating
    finally:
        prober.stop.set()
        prober.join(timeout=60)


def run_probed(model, config: dict, prompts, calls: int = 3, until_failure: bool = False):
    """`calls` generate calls (or up to 30 until the prober sees a failure); returns (prober, last result)."""
    rollout = Rollout(model, config=RolloutConfig(**config))
    sampling = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4)
    with probing(model) as (prober, generating):
        for _ in range(30 if until_failure else calls):
            generating.set()
            result = rollout.generate(prompts, sampling)
            generating.clear()
            if until_failure and prober.failures:
                break
    return prober, result


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("tiny-qwen2", seed=21)


@pytest.mark.parametrize("name", sorted(ROUTE_CONFIGS))
def test_other_threads_forwards_and_the_model_state_are_untouched(model, name):
    prompts = random_prompts(LENGTHS, seed=5)
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    rng_before, state_before = torch.get_rng_state(), model_state(model)
    prober, result = run_probed(model, ROUTE_CONFIGS[name], prompts)
    assert not prober.failures, prober.failures[:3]
    assert prober.overlapped >= 2, "the probe never ran while generate did: the test proved nothing"
    assert_matches_oracle(result, tokens, reasons)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert model_state(model) == state_before
    if name in ("packed", "invariant_kernels"):
        assert any(len(bucket) > 1 for admission in result.profile.prefill_groups for bucket in admission)
    if name == "chunked":
        assert "chunked" in {form for forms in result.profile.prefill_forms for form in forms}


def test_the_compiled_decode_step_leaves_other_threads_alone():
    model = build_tiny_model("tiny-llama", seed=23)  # its own model: its own compiled graph
    prompts = random_prompts([7, 23, 12, 30], seed=3)
    tokens, reasons = oracle_batch(model, prompts, BUDGET, eos_token_id=[])
    rollout = Rollout(model, config=RolloutConfig(route="aligned", compile=True))
    sampling = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4, eos_token_id=[])
    rollout.generate(prompts, sampling)  # compile first, so the probe overlaps compiled steps
    state_before = model_state(model)
    with probing(model) as (prober, generating):
        for _ in range(3):
            generating.set()
            result = rollout.generate(prompts, sampling)
            generating.clear()
    assert result.profile.compiled_steps > 0, result.profile.compile_fallback
    assert not prober.failures, prober.failures[:3]
    assert prober.overlapped >= 2
    assert result.tokens == tokens
    assert model_state(model) == state_before


# ---- negative controls: the probe catches a mutating engine -------------------------------------------


def test_control_a_config_swap_around_the_packed_forward_is_caught(model, monkeypatch):
    from transformers import AttentionInterface

    selected = packed_prefill._segments_selected
    AttentionInterface.register("autobucket_test_swap", packed_prefill._segment_attention)

    @contextmanager
    def swapping(bounds):  # what the engine did before: write the model's config for the forward
        with selected(bounds) as packing:
            before, model.config._attn_implementation = model.config._attn_implementation, "autobucket_test_swap"
            try:
                yield packing
            finally:
                model.config._attn_implementation = before

    monkeypatch.setattr(packed_prefill, "_segments_selected", swapping)
    prober, _ = run_probed(model, ROUTE_CONFIGS["packed"], random_prompts(LENGTHS, seed=5), until_failure=True)
    assert prober.failures, "the probe did not see the config swap: it cannot catch one"


def test_control_forward_hooks_around_ordinary_generate_are_caught(model, monkeypatch):
    original = ordinary._generate_batch

    def hooked(model_, *args, **kwargs):  # what the ordinary route did before: time forwards by hooks
        handle = model_.register_forward_hook(lambda *a: None)
        try:
            return original(model_, *args, **kwargs)
        finally:
            handle.remove()

    monkeypatch.setattr(ordinary, "_generate_batch", hooked)
    prober, _ = run_probed(model, ROUTE_CONFIGS["ordinary"], random_prompts(LENGTHS, seed=5), until_failure=True)
    assert any("state" in failure for failure in prober.failures)


def test_control_the_probe_sees_a_changed_weight():
    """The prober's bitwise oracle does fail when another thread's forward really changes."""
    model = build_tiny_model("tiny-qwen2", seed=22)  # its own: the weight stays changed
    with probing(model) as (prober, _):
        with torch.no_grad():
            model.lm_head.weight.mul_(1.0 + 1e-3)
        for _ in range(200):
            if prober.failures:
                break
            threading.Event().wait(0.05)
    assert any("differ" in failure for failure in prober.failures)


def test_two_threads_generating_on_one_model_at_once_both_match_the_oracle(model):
    """The engine's attention choice is per thread: a packed call and a chunked call at the same time."""
    prompts = random_prompts(LENGTHS, seed=6)
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    sampling = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4)
    results, errors = {}, []

    def worker(name: str) -> None:
        torch.set_num_threads(1)
        try:
            rollout = Rollout(model, config=RolloutConfig(**ROUTE_CONFIGS[name]))
            results[name] = [rollout.generate(prompts, sampling) for _ in range(3)]
        except Exception as error:  # noqa: BLE001 - re-raised below in the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("packed", "chunked")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for name in ("packed", "chunked"):
        for result in results[name]:
            assert_matches_oracle(result, tokens, reasons)


class ForwardLog:
    """Which thread ran each forward of the model (a pre-hook on its input embeddings, which every forward
    and the direct decode step run); thread "first"'s first forward waits until `release` is set."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.threads: list[str] = []
        self.first_entered, self.release = threading.Event(), threading.Event()
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        name = threading.current_thread().name
        self.threads.append(name)
        if name == "first" and not self.release.is_set():
            self.first_entered.set()
            self.release.wait(timeout=60)


SHARED_STATE_CONFIG = dict(route="bucketed", kernels="invariant", prefix_cache_mb=16, costs=PACK_EVERYTHING)


def generate_in_two_threads(first: Rollout, second: Rollout, prompts, sampling) -> tuple[list, list[str], dict]:
    """`first` starts a call and is held at its first forward; then `second` starts one. Returns the
    threads whose forwards ran while `first` was held, and both results."""
    log, results, errors = ForwardLog(first.model), {}, []
    second_started = threading.Event()

    def call(name: str, rollout: Rollout) -> None:
        torch.set_num_threads(1)
        try:
            if name == "second":
                log.first_entered.wait(timeout=60)
                second_started.set()
            results[name] = rollout.generate(prompts, sampling)
        except Exception as error:  # noqa: BLE001 - re-raised below in the main thread
            errors.append(error)

    threads = [threading.Thread(target=call, args=(name, r), name=name) for name, r in (("first", first), ("second", second))]
    try:
        for thread in threads:
            thread.start()
        assert log.first_entered.wait(timeout=60) and second_started.wait(timeout=60)
        threading.Event().wait(0.5)  # time for the second call to reach the model, were it not held back
        while_held = list(log.threads)
    finally:
        log.release.set()
        for thread in threads:
            thread.join(timeout=120)
        log.handle.remove()
    assert not errors, errors
    return while_held, log.threads, results


def test_calls_on_one_rollout_from_two_threads_run_one_at_a_time_as_in_turn(model):
    """A Rollout's prefix cache, learned costs and stop-string matcher belong to it: another thread's call
    waits for the one in flight, so both get what the same two calls made in turn get (the second
    continuing from the first's cached sequences), sampled tokens and logprobs bitwise."""
    prompts = random_prompts(LENGTHS, seed=8)
    sampling = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4, temperature=1.0, seed=5, logprobs=True)
    in_turn = Rollout(model, config=RolloutConfig(**SHARED_STATE_CONFIG))
    expected = [in_turn.generate(prompts, sampling) for _ in range(2)]
    assert expected[1].profile.cached_prompt_tokens > 0  # the second call read the first's sequences
    rollout = Rollout(model, config=RolloutConfig(**SHARED_STATE_CONFIG))
    while_held, ran, results = generate_in_two_threads(rollout, rollout, prompts, sampling)
    assert set(while_held) == {"first"}  # the second call did not start a forward while the first was held
    assert ran.index("second") > len(ran) - ran[::-1].index("first") - 1  # every first forward before it
    for name, reference in zip(("first", "second"), expected, strict=True):
        assert results[name].tokens == reference.tokens and results[name].logprobs == reference.logprobs
    assert results["second"].profile.cached_prompt_tokens == expected[1].profile.cached_prompt_tokens


def test_control_two_rollouts_of_one_model_do_run_at_once(model):
    """The probe above can see calls overlap: two Rollouts of the model run in parallel (each with its own
    prefix cache), and each still gets the result it gets alone."""
    prompts = random_prompts(LENGTHS, seed=8)
    sampling = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4, temperature=1.0, seed=5, logprobs=True)
    alone = Rollout(model, config=RolloutConfig(**SHARED_STATE_CONFIG)).generate(prompts, sampling)
    first, second = (Rollout(model, config=RolloutConfig(**SHARED_STATE_CONFIG)) for _ in range(2))
    while_held, _, results = generate_in_two_threads(first, second, prompts, sampling)
    assert "second" in while_held
    for result in results.values():
        assert result.tokens == alone.tokens and result.logprobs == alone.logprobs


def test_the_tiny_model_builders_leave_the_global_rng_alone():
    from autobucket.models import load_model

    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    first = build_tiny_model("tiny-llama", seed=5)
    load_model("tiny-qwen2")
    assert torch.equal(torch.rand(3), expected)  # the caller's stream continues as if nothing ran
    again = build_tiny_model("tiny-llama", seed=5)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters(), strict=True))


# ---- process-wide settings a trainer may have changed ----------------------------------------------------


@pytest.mark.parametrize("kernels", ["hf", "invariant"])
def test_a_float64_default_dtype_changes_nothing(kernels):
    """A trainer's `torch.set_default_dtype(torch.float64)` (scientific code does it) reaches every tensor
    the engine creates without a dtype: a probe's random logits made the trainer-logprob kernel refuse
    them (RuntimeError), a cascade's merge weights ran in float64. Every route, sampled with both logprob
    modes, n > 1 on shared K/V, penalty, packed and chunked prefill, must give bitwise the float32
    default's tokens and logprobs."""
    model = build_tiny_model("tiny-llama", seed=40)
    prompts = random_prompts(LENGTHS, seed=7)
    calls = [
        (dict(route="bucketed", costs=PACK_EVERYTHING), dict(n=3, temperature=1.0, top_p=0.9, logprobs=True)),
        (dict(route="aligned", prefill_max_tokens=8), dict(temperature=0.8, logprobs=True, logprobs_mode="processed")),
        (dict(route="ordinary"), dict(temperature=1.0, logprobs=True, repetition_penalty=1.3)),
        (dict(route="equal_width"), dict(n=2, temperature=1.0, logprobs=True)),
    ]

    def run_all():
        results = []
        for config, sampling in calls:
            rollout = Rollout(model, config=RolloutConfig(kernels=kernels, **config))
            result = rollout.generate(prompts, SamplingConfig(max_new_tokens=BUDGET, seed=11, **sampling))
            results.append((result.tokens, result.logprobs))
        return results

    expected = run_all()
    torch.set_default_dtype(torch.float64)
    try:
        assert run_all() == expected
    finally:
        torch.set_default_dtype(torch.float32)


def test_the_kernel_probes_answer_alike_under_a_float64_default():
    """The probes that decide, once per process, whether a kernel takes a call build their own random
    inputs: under a float64 default they must answer as under float32 (the trainer-logprob probe raised
    there, and whichever call came first would have decided for the process)."""
    from transformers.models.llama import modeling_llama

    from autobucket.engine.kernels import onednn_probes, trainer_reductions
    from autobucket.engine.kernels.elementwise import rotary

    probes = {"rotary": lambda: rotary.router_for.__wrapped__(modeling_llama.apply_rotary_pos_emb) is not None}
    if trainer_reductions.kernel_library_builds():  # loads the library the two reductions probe
        probes["logsumexp"] = trainer_reductions._logsumexp_agrees
        if torch.ops.autobucket.trainer_log_softmax_at_available():
            probes["log_softmax"] = trainer_reductions._log_softmax_agrees
    if onednn_probes.native_bf16_gemm():  # oneDNN runs bf16 GEMMs here (AVX-512 or AVX-NE-CONVERT)
        probes["bf16 blocks"] = lambda: onednn_probes.bf16_blocks_invariant.__wrapped__(64, 96)
        probes["fused columns"] = lambda: onednn_probes.fused_columns_agree.__wrapped__(64, (32, 48), True)
    expected = {name: probe() for name, probe in probes.items()}
    torch.set_default_dtype(torch.float64)
    try:
        assert {name: probe() for name, probe in probes.items()} == expected
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("kernels", ["hf", "invariant"])
def test_deterministic_algorithms_on_change_nothing(kernels, model):
    """`torch.use_deterministic_algorithms(True)` (what a reproducibility-minded trainer sets) refuses
    nondeterministic ops with an error: no route may use one, and the tokens stay HF generate's."""
    prompts = random_prompts(LENGTHS, seed=5)
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for config in ROUTE_CONFIGS.values():
            if config.get("kernels", kernels) != kernels:
                continue
            result = Rollout(model, config=RolloutConfig(**{**config, "kernels": kernels})).generate(
                prompts, SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4)
            )
            assert_matches_oracle(result, tokens, reasons)
    finally:
        torch.use_deterministic_algorithms(before)
