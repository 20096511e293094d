"""Models the continuous-batching routes cannot run as they are, and what each route does with them.

1. Sliding attention windows (Mistral, Gemma 2/3, Qwen2 with `use_sliding_window`, Phi-3). When a sequence
   of a call outgrows the window, the continuous-batching routes narrow each sliding layer's attention to
   it (the dispatcher windows the masks the engine builds; prefill K/V kept whole; dense packing; a
   prompt's samples share one copy of its K/V, each row reading the shared keys its window covers; no
   compiled step). The oracle is single-request HF `generate`, which applies the window; a
   control (the same weights with the window off) shows that the sequences do outgrow it, and another
   (the windows not applied) that the oracle catches a route that ignores them. Every CB route and
   prefill form (padded, per-prompt, chunked, packed), n > 1, the prefix cache across turns, both kernel
   sets; under `kernels="invariant"` a prompt's sampled logprobs are bitwise the same alone and in a
   batch on every form. A model on eager attention (no dispatcher) is refused by the CB routes and run
   as ordinary `generate` by auto; the cost probe stays inside the window (it ran CB calls of 518 tokens,
   so every call of a model with a 512-token window, Gemma 3 1B's, raised on the default route before).
2. Attention backends other than SDPA and eager (flash_attention_2 on a GPU trainer, flex_attention, a
   kernels-hub or registered function; here a registered one that runs SDPA, since CPU flex_attention
   fails inside torch's compiler on a padded batch even in plain HF `generate`). `ordinary` runs them
   (a Rollout of such a model raised at construction on every route), `auto` runs ordinary without
   probing CB costs, the CB routes refuse by name, and a trainer switching backends between calls is
   followed.
3. A class transformers gives no SDPA attention (gpt-oss: attention sinks; Gemma 2 in 5.x) runs eager:
   the default kernels run it on every route; `kernels="invariant"` refuses it, naming `kernels='torch'` as
   the fix (not a switch to SDPA, which that class refuses).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
from oracles import oracle_generate
from windowed_models import SLIDING_WINDOW, WINDOWED_BASE, WINDOWED_CONFIGS, windowed_model
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients

pytestmark = pytest.mark.engine

WINDOW = SLIDING_WINDOW
_BASE = WINDOWED_BASE
NEW_TOKENS = 12
WINDOWED = WINDOWED_CONFIGS


def without_window(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights attending over everything: the window made wider than any sequence here."""
    wide = copy.deepcopy(model)
    wide.config.sliding_window = 1 << 20
    for module in wide.modules():
        if isinstance(getattr(module, "sliding_window", None), int):
            module.sliding_window = 1 << 20
    return wide


def oracle(model, prompts) -> list[list[int]]:
    return [oracle_generate(model, prompt, NEW_TOKENS, eos_token_id=[])[0] for prompt in prompts]


SAMPLING = SamplingConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[], greedy_copies=True)  # n > 1: the answer n times
LONG = random_prompts([5, 9, 21, 30], seed=3)  # 21 + 12 and 30 + 12 outgrow the window; 5 + 12 too
SHORT = random_prompts([2, 3, 1], seed=4)  # every sequence inside the window (at most 15 tokens)


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_window_control_changes_the_oracle(name):
    """The prompts outgrow the window: without it the same weights generate other tokens."""
    model = windowed_model(name)
    assert oracle(without_window(model), LONG) != oracle(model, LONG)


FORMS = {
    "equal_width": {"route": "equal_width"},
    "aligned": {"route": "aligned"},
    "chunked": {"route": "aligned", "prefill_max_tokens": 8},
    "packed": {"route": "bucketed", "costs": CostCoefficients(fixed_ms=1e4)},  # a high fixed cost packs
}


@pytest.mark.parametrize("share", [False, True], ids=["copies", "cascade"])
@pytest.mark.parametrize("kernels", ["hf", "invariant"])
@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_every_form_attends_within_the_window(name, kernels, share, request):
    """Every prefill form, n = 1 and 3; `share`: a prompt's samples decode over one shared copy of its K/V."""
    if share:
        request.getfixturevalue("always_share")
    model = windowed_model(name)
    expected = oracle(model, LONG)
    for form, keywords in FORMS.items():
        for n in (1, 3):
            result = Rollout(model, None, RolloutConfig(**keywords, kernels=kernels)).generate(
                LONG, dataclasses.replace(SAMPLING, n=n))
            rows = result.tokens if n == 1 else [samples[0] for samples in result.tokens]
            assert rows == expected, f"{form} n={n}"
            if n > 1:  # greedy: every sample of a prompt is its one answer
                assert all(samples == [samples[0]] * n for samples in result.tokens), f"{form} n={n}"
                assert (result.profile.shared_kv_rows > 0) == share, f"{form} n={n}"
            if form == "packed":
                assert ["packed"] in result.profile.prefill_forms


def test_control_windows_not_applied_fail_the_oracle(monkeypatch):
    from autobucket.engine import routes

    monkeypatch.setattr(routes, "sliding_windows_applied", contextlib.nullcontext)
    model = windowed_model("mistral")
    result = Rollout(model, None, RolloutConfig(route="aligned")).generate(LONG, SAMPLING)
    assert result.tokens != oracle(model, LONG)


def test_invariant_logprobs_within_the_window_are_the_same_alone_and_in_a_batch():
    """Under kernels='invariant' the windowed attention counts its key blocks from each query's first
    key in the window, so a prompt's sampled tokens and logprobs do not depend on its batch or form."""
    model = windowed_model("gemma3")
    sampled = SamplingConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[], temperature=1.0, seed=[5, 6, 7, 8],
                             logprobs=True)  # fmt: skip
    answers = []
    for keywords in FORMS.values():
        rollout = Rollout(model, None, RolloutConfig(**keywords, kernels="invariant"))
        batch = rollout.generate(LONG, sampled)
        alone = rollout.generate(LONG[3:], dataclasses.replace(sampled, seed=[8]))
        assert (alone.tokens[0], alone.logprobs[0]) == (batch.tokens[3], batch.logprobs[3])
        answers.append((batch.tokens, batch.logprobs))
    assert all(answer == answers[0] for answer in answers)


@pytest.mark.parametrize("kernels", ["hf", "invariant"])
def test_auto_plans_a_call_outgrowing_the_window_as_any_other(kernels):
    model = windowed_model("qwen2")
    rollout = Rollout(model, None, RolloutConfig(route="auto", kernels=kernels, compile=True))
    result = rollout.generate(LONG, SAMPLING)  # the online probe ran inside the window first
    assert result.tokens == oracle(model, LONG)
    assert "sliding" not in result.profile.decision_reason
    if result.route == "bucketed":  # the compiled step does not narrow attention to the window
        assert "sliding window: decodes eagerly" in result.profile.compile_decision


# how a shared prompt's decode attention runs: the invariant kernels; the default kernels on the engine's
# kernel; the default kernels' two flash parts merged (where the kernel cannot take the call)
CASCADE_DECODES = {
    "invariant": {"kernels": "invariant"}, "engine kernel": {"op_backends": {"decode_attention": "cpu"}},
    "flash parts": {}, "math parts": {},
}
SAMPLED = dataclasses.replace(SAMPLING, n=3, temperature=1.0, seed=[5, 6, 7, 8], logprobs=True,
                             continuous_batch_size=5)  # 12 rows on 5: a prompt's samples split over admissions, refilled


@pytest.mark.parametrize("decode", sorted(CASCADE_DECODES))
@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_samples_past_the_window_read_one_copy_of_their_prompt(name, decode, always_share, monkeypatch):
    """A prompt's n samples keep one copy of its K/V past the window too (cascade decode): a sliding
    layer's row reads the shared keys its window still covers, then its own. The 21- and 30-token prompts
    start past the 16-token window, the 5- and 9-token ones outgrow it while decoding. Greedy: every sample
    is the oracle's answer. Sampled: tokens and logprobs equal the same call with per-row copies, bitwise
    on the engine's kernel (the rows read the same keys in the same blocks), within 1e-5 as flash parts."""
    from autobucket.engine import routes

    if decode in ("flash parts", "math parts"):  # math parts: the form a GPU runs, here on the CPU
        monkeypatch.setattr(routes, "_decode_attention", lambda call: None)
    if decode == "math parts":
        from autobucket.engine.kernels import shared_prefix_attention

        monkeypatch.setattr(shared_prefix_attention, "_MATH_PARTS", True)
    model = windowed_model(name)
    config = RolloutConfig(route="aligned", compile=False, **CASCADE_DECODES[decode])
    greedy = Rollout(model, None, config).generate(LONG, dataclasses.replace(SAMPLING, n=3))
    assert greedy.profile.shared_kv_rows > 0
    assert greedy.profile.decode_forward == ("model" if name == "gemma3" else "direct")  # Llama family: the direct step
    assert greedy.tokens == [[answer] * 3 for answer in oracle(model, LONG)]
    shared = Rollout(model, None, config).generate(LONG, SAMPLED)
    monkeypatch.setattr(routes, "_shared_prefix_allowed", lambda call: False)
    copies = Rollout(model, None, config).generate(LONG, SAMPLED)
    assert (shared.profile.shared_kv_rows > 0, copies.profile.shared_kv_rows) == (True, 0)
    assert shared.tokens == copies.tokens
    flat = [(a, b) for p, q in zip(shared.logprobs, copies.logprobs, strict=True)
            for s, c in zip(p, q, strict=True) for a, b in zip(s, c, strict=True)]  # fmt: skip
    if decode in ("flash parts", "math parts"):
        assert max(abs(a - b) for a, b in flat) < 1e-5
    else:
        assert all(a == b for a, b in flat)


@pytest.mark.parametrize("kernels", ["hf", "invariant"])
def test_control_a_cascade_reading_every_shared_key_fails_the_oracle(kernels, always_share, monkeypatch):
    """Negative control: the shared part read whole (the window not passed to the cascade) while each
    row's own keys stay windowed: the 21- and 30-token prompts' samples then attend past the window. The
    model's own forward runs each step (the kernel step would call the cascade's kernel itself)."""
    from autobucket.engine.decode.parts import LlamaParts
    from autobucket.engine.kernels import shared_prefix_attention

    monkeypatch.setattr(shared_prefix_attention, "windows_applied", lambda: False)
    monkeypatch.setattr(LlamaParts, "of", classmethod(lambda cls, model: None))
    model = windowed_model("mistral")
    config = RolloutConfig(route="aligned", compile=False, kernels=kernels)
    result = Rollout(model, None, config).generate(LONG, dataclasses.replace(SAMPLING, n=3))
    assert result.profile.shared_kv_rows > 0
    assert [samples[0] for samples in result.tokens] != oracle(model, LONG)


@pytest.mark.parametrize("n", [1, 3])
def test_the_prefix_cache_serves_a_conversation_past_the_window(n, always_share):
    """Three turns, the second and third past the window: each equals the oracle over the whole
    conversation and prefills only its new tokens (the cached K/V is kept whole, windowed when read);
    with n = 3 the samples of each turn decode over one shared copy of the continued conversation."""
    model = windowed_model("mistral")
    rollout = Rollout(model, None, RolloutConfig(route="auto", prefix_cache_mb=8))
    conversation, previous = list(LONG[2]), 0
    for turn in range(3):
        result = rollout.generate([conversation], dataclasses.replace(SAMPLING, n=n))
        if n > 1:
            assert result.profile.shared_kv_rows > 0 and result.tokens[0] == [result.tokens[0][0]] * n, turn
            result.tokens[0] = result.tokens[0][0]  # greedy: every sample is the one answer
        assert result.tokens == oracle(model, [conversation]), turn
        cached = result.profile.cached_prompt_tokens
        assert cached >= previous and result.profile.prefill_tokens == len(conversation) - cached, turn
        previous = len(conversation)  # its K/V is all cached at the end of the call, and the answer's
        conversation = conversation + result.tokens[0] + [7, 8, 9]


@pytest.mark.parametrize("cascade", [False, True], ids=["copies", "cascade"])
@pytest.mark.parametrize("kernels", ["hf", "invariant"])
def test_a_shared_prompt_longer_than_the_window_is_prefilled_once(kernels, cascade, request):
    """A 40-token header shared by six prompts (2.5 windows): prefilled once, each prompt continued over
    it, with n = 1 and n = 4 (greedy: every sample is the one answer). `cascade`: every row decodes over
    one shared copy of the header's K/V (its own columns hold its tail and answer; a sliding layer reads
    the header's keys its window still covers), else each row holds a copy."""
    if cascade:
        request.getfixturevalue("always_share")
    model = windowed_model("gemma3")
    header = random_prompts([40], seed=21)[0]
    prompts = [header + tail for tail in random_prompts([3, 7, 5, 9, 2, 4], seed=22)]
    expected = oracle(model, prompts)
    for n in (1, 4):
        result = Rollout(model, None, RolloutConfig(route="bucketed", kernels=kernels)).generate(
            prompts, dataclasses.replace(SAMPLING, n=n))
        assert [samples if n == 1 else samples[0] for samples in result.tokens] == expected, n
        # every group continues over the header (the planner may split the continuations into groups)
        assert all(form == "continued" for admission in result.profile.prefill_forms for form in admission), n
        tails = [len(p) - len(header) for p in prompts]  # continuations: at most one padded forward's worth
        assert len(header) < result.profile.prefill_tokens <= len(header) + len(prompts) * max(tails), n
        assert (result.profile.shared_kv_rows > 0) == cascade, n


@pytest.mark.parametrize("route", ["equal_width", "aligned", "bucketed"])
def test_eager_attention_past_the_window_is_refused_by_the_continuous_routes(route):
    model = windowed_model("mistral", "eager")
    rollout = Rollout(model, None, RolloutConfig(route=route))
    with pytest.raises(ValueError, match=rf"sliding attention window of {WINDOW} tokens and this call needs 42 with attn_implementation='eager': load the model with attn_implementation='sdpa'"):
        rollout.generate(LONG, SAMPLING)
    assert rollout.generate(SHORT, SAMPLING).tokens == oracle(model, SHORT)  # inside the window


def test_auto_runs_ordinary_for_eager_attention_past_the_window():
    model = windowed_model("mistral", "eager")
    result = Rollout(model, None, RolloutConfig(route="auto")).generate(LONG, SAMPLING)
    assert result.route == "ordinary" and "applies only where attention goes through SDPA" in result.profile.decision_reason
    assert result.tokens == oracle(model, LONG)
    with pytest.raises(ValueError, match=r"sliding attention window.*trim_cache=True was requested"):
        Rollout(model, None, RolloutConfig(route="auto", trim_cache=True)).generate(LONG, SAMPLING)


# ---------------------------------------------------------------- other attention backends
BACKEND = "autobucket_test_attention"


@pytest.fixture(scope="module")
def registered_backend() -> str:
    """A backend transformers dispatches by name that the CB routes do not know (it runs SDPA)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(*args, **kwargs):
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register(BACKEND, attention)
    AttentionMaskInterface.register(BACKEND, sdpa_mask)  # as a real backend's registration does
    return BACKEND


def backend_model(backend: str) -> torch.nn.Module:
    from autobucket.models import build_tiny_model

    return build_tiny_model("tiny-qwen2", attn_implementation=backend)


@pytest.mark.parametrize("prefix_cache_mb", [0, 8])
def test_ordinary_runs_a_model_on_another_attention_backend(registered_backend, prefix_cache_mb):
    model = backend_model(registered_backend)
    rollout = Rollout(model, None, RolloutConfig(route="ordinary", prefix_cache_mb=prefix_cache_mb))
    result = rollout.generate(LONG, SAMPLING)
    assert result.route == "ordinary" and result.tokens == oracle(model, LONG)


def test_auto_runs_ordinary_on_another_attention_backend_without_probing(registered_backend, monkeypatch):
    import autobucket.costs.source as cost_source

    def no_probe(*args, **kwargs):
        raise AssertionError("the online probe runs continuous-batching calls this model cannot run")

    monkeypatch.setattr(cost_source, "probe", no_probe)
    model = backend_model(registered_backend)
    rollout = Rollout(model, None, RolloutConfig(route="auto", prefix_cache_mb=8))
    result = rollout.generate(LONG, SAMPLING)
    assert result.route == "ordinary"
    assert f"attn_implementation={registered_backend!r}" in result.profile.decision_reason
    assert result.tokens == oracle(model, LONG)


@pytest.mark.parametrize("route", ["equal_width", "aligned", "bucketed"])
def test_continuous_routes_refuse_another_attention_backend(registered_backend, route):
    rollout = Rollout(backend_model(registered_backend), None, RolloutConfig(route=route))
    with pytest.raises(ValueError, match=rf"attn_implementation='{registered_backend}'.*'sdpa', 'eager'.*route='ordinary'"):
        rollout.generate(LONG, SAMPLING)


def test_auto_follows_a_trainer_switching_attention_backends(registered_backend):
    """sdpa -> the registered backend -> sdpa between calls: each call runs what the model is now."""
    model = backend_model("sdpa")
    rollout = Rollout(model, None, RolloutConfig(route="auto"))
    expected = oracle(model, LONG)
    routes = []
    for backend in ("sdpa", registered_backend, "sdpa"):
        model.set_attn_implementation(backend)
        result = rollout.generate(LONG, SAMPLING)
        assert result.tokens == expected, backend
        routes.append(result.route)
    assert routes[1] == "ordinary" and routes[0] == routes[2]


# ---------------------------------------------------------------- a class with eager attention only
def eager_only_model() -> torch.nn.Module:
    import transformers

    config = transformers.GptOssConfig(**{**_BASE, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                          "sliding_window": 4096, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert not type(model)._supports_sdpa, "this release gives gpt-oss SDPA: pick another eager-only class"
    return model.eval()


def test_an_eager_only_class_runs_on_the_default_kernels_and_invariant_names_the_fix():
    model = eager_only_model()
    expected = oracle(model, SHORT)
    for route in ("ordinary", "equal_width", "aligned", "bucketed", "auto"):
        assert Rollout(model, None, RolloutConfig(route=route)).generate(SHORT, SAMPLING).tokens == expected, route
    with pytest.raises(ValueError, match=r"GptOssForCausalLM has attn_implementation='eager': this transformers release has no SDPA attention for it, so use RolloutConfig\(kernels='torch'\)"):
        Rollout(model, None, RolloutConfig(kernels="invariant"))
