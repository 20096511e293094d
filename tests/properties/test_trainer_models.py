"""The models trainers hand over: a LoRA `PeftModel` (unmerged, active adapter, several adapters), DDP and
`torch.compile` wrappers, gradient checkpointing, `train()` mode with dropout, tied embeddings.

Oracle: the same object's single-request greedy `generate` (a PeftModel generates through its adapters,
a model in train mode is asked in eval mode before it is switched). Every route must match it token for
token, and leave the handed-over object as found. Negative controls: the adapter changes the oracle
(else a test that ignored it would pass), and without eval semantics dropout changes the tokens."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import pytest
import torch
from oracles import assert_matches_oracle, hf_greedy, mismatches, oracle_batch
from workloads import random_prompts, steering_hook

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.engine import rollout as rollout_module
from autobucket.models import build_tiny_model

peft = pytest.importorskip("peft")

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("single_thread")]

LENGTHS = (5, 17, 30, 3, 9, 12)
BUDGET = 6
ROUTE_CONFIGS = {
    "ordinary": dict(route="ordinary"),
    "equal_width": dict(route="equal_width"),
    "aligned": dict(route="aligned", prefill_max_tokens=8),  # chunked
    "bucketed": dict(route="bucketed", costs=CostCoefficients(fixed_ms=1e4)),  # packed
    "auto": dict(route="auto", costs=CostCoefficients()),
}


def sampling() -> SamplingConfig:
    return SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4)


def lora(model, name: str = "default", seed: int = 0):
    """An unmerged LoRA with random B (peft's default B = 0 would make the adapter a no-op)."""
    config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(model, peft.PeftModel):
            model.add_adapter(name, config)
            return model
        return peft.get_peft_model(model, config, adapter_name=name)


@pytest.fixture(scope="module")
def peft_model():
    return lora(build_tiny_model("tiny-qwen2", seed=31)).eval()


@pytest.mark.parametrize("route", sorted(ROUTE_CONFIGS))
def test_a_lora_peft_model_matches_its_own_generate_on_every_route(peft_model, route):
    prompts = random_prompts(LENGTHS, seed=7)
    tokens, reasons = oracle_batch(peft_model, prompts, BUDGET)
    result = Rollout(peft_model, config=RolloutConfig(**ROUTE_CONFIGS[route])).generate(prompts, sampling())
    assert_matches_oracle(result, tokens, reasons)


def test_control_the_adapter_changes_the_oracle(peft_model):
    prompts = random_prompts(LENGTHS, seed=7)
    with peft_model.disable_adapter():
        base_tokens, _ = oracle_batch(peft_model.get_base_model(), prompts, BUDGET)
    assert mismatches(oracle_batch(peft_model, prompts, BUDGET)[0], base_tokens)


@pytest.mark.parametrize("route", ["ordinary", "bucketed"])
def test_several_adapters_generate_with_the_active_one(route):
    model = lora(lora(build_tiny_model("tiny-llama", seed=32)), "second", seed=1).eval()
    prompts = random_prompts(LENGTHS, seed=8)
    rollout = Rollout(model, config=RolloutConfig(**ROUTE_CONFIGS[route]))
    answers = {}
    for adapter in ("default", "second"):
        model.set_adapter(adapter)
        tokens, reasons = oracle_batch(model, prompts, BUDGET)
        assert_matches_oracle(rollout.generate(prompts, sampling()), tokens, reasons)
        answers[adapter] = tokens
        del tokens
        from oracles import forget_oracle

        forget_oracle(model)  # the oracle cache is keyed by model, not by active adapter
    assert answers["default"] != answers["second"]
    assert model.active_adapter == "second"


# Adapters peft injects into the layers, beyond plain LoRA on attention: each runs inside the base model's
# forward, so every route must equal the PeftModel's own generate (both kernel sets: the packed linears
# take the base weight and leave the adapter's path to peft's layer).
ADAPTER_KINDS = {
    "dora": lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True),
    "rslora_on_the_head_and_embeddings": lambda: peft.LoraConfig(
        r=4, target_modules=["embed_tokens", "lm_head", "o_proj"], use_rslora=True),
    "lora_with_a_trained_head_copy": lambda: peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "loha": lambda: peft.LoHaConfig(r=4, target_modules=["q_proj", "v_proj"]),
    "lokr": lambda: peft.LoKrConfig(r=4, target_modules=["q_proj", "gate_proj"]),
}  # fmt: skip


def adapter_of_kind(kind: str):
    """A PeftModel whose adapter changes the tokens: its zero-initialised factors (LoRA's B, IA3's ones,
    DoRA's magnitudes, a saved head copy) are moved off their no-op values."""
    model = peft.get_peft_model(build_tiny_model("tiny-qwen2", seed=33), ADAPTER_KINDS[kind]())
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        for parameter in model.parameters():
            if parameter.requires_grad:  # the adapter's own parameters (and the saved head copy)
                parameter.add_(torch.randn_like(parameter) * 0.3)
    return model.eval()


@pytest.mark.parametrize("kernels", ["hf", "invariant"])
@pytest.mark.parametrize("kind", sorted(ADAPTER_KINDS))
def test_adapters_in_the_layers_match_the_peft_models_own_generate(kind, kernels):
    model = adapter_of_kind(kind)
    prompts = random_prompts(LENGTHS, seed=9)
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    with model.disable_adapter():  # control: the adapter changes the oracle
        assert mismatches(tokens, oracle_batch(model.get_base_model(), prompts, BUDGET)[0])
    for route in ("ordinary", "aligned", "bucketed"):
        config = RolloutConfig(**{**ROUTE_CONFIGS[route], "kernels": kernels})
        assert_matches_oracle(Rollout(model, config=config).generate(prompts, sampling()), tokens, reasons)


@pytest.mark.parametrize("method", ["prompt", "prefix"])
def test_prompt_learning_adapters_are_refused_by_name(method):
    """Their virtual tokens are added by PeftModel.forward, outside the base model the engine runs: a
    Rollout generated as if the adapter were off (probed), so it refuses them."""
    configs = {"prompt": peft.PromptTuningConfig, "prefix": peft.PrefixTuningConfig}
    model = peft.get_peft_model(build_tiny_model("tiny-qwen2"), configs[method](task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match=rf"{method.upper()}_TUNING, a prompt-learning method.*LoRA"):
        Rollout(model)
    if method == "prompt":  # control: the virtual tokens change what the PeftModel generates
        prompt = torch.tensor([random_prompts([9], seed=10)[0]])

        def last_tokens(generator) -> list[int]:
            with torch.inference_mode():
                output = generator.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                            max_new_tokens=BUDGET, do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
            return output[0, -BUDGET:].tolist()

        assert last_tokens(model) != last_tokens(model.get_base_model())


@contextlib.contextmanager
def one_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def wrap(wrapper: str, model):
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if wrapper == "compiled":
        return torch.compile(model)
    if wrapper == "fsdp1":
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    if wrapper == "fsdp2":  # shards in place: the layers, then the root (its hooks all-gather per forward)
        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    return DistributedDataParallel(model)


@pytest.mark.parametrize("wrapper", ["ddp", "compiled", "ddp_of_peft", "fsdp1", "fsdp2"])
def test_wrapped_models_match_the_inner_models_generate(wrapper, peft_model):
    """One process (gloo, world size 1): FSDP's unsharding hooks and the engine's autograd mode meet for real
    (FSDP2's unshard needs version counters, which inference tensors lack)."""
    inner = peft_model if wrapper == "ddp_of_peft" else build_tiny_model("tiny-mistral", seed=33)
    prompts = random_prompts(LENGTHS, seed=9)
    tokens, reasons = oracle_batch(inner, prompts, BUDGET)
    with one_process_group():
        wrapped = wrap(wrapper, inner)
        for route in ("ordinary", "bucketed"):
            result = Rollout(wrapped, config=RolloutConfig(**ROUTE_CONFIGS[route])).generate(prompts, sampling())
            assert_matches_oracle(result, tokens, reasons)


def dropout_model():
    """A GPT-2 (tied embeddings) with real dropout everywhere, so train-mode forwards differ."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=1024, initializer_range=0.2,
                        resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3, bos_token_id=1, eos_token_id=2)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(34)
        return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("route", sorted(ROUTE_CONFIGS))
def test_a_model_in_train_mode_with_gradient_checkpointing_generates_with_eval_semantics(route):
    model = dropout_model()
    prompts = random_prompts(LENGTHS, seed=10)
    tokens, reasons = oracle_batch(model, prompts, BUDGET)  # eval mode
    model.gradient_checkpointing_enable()
    model.train()
    result = Rollout(model, config=RolloutConfig(**ROUTE_CONFIGS[route])).generate(prompts, sampling())
    assert_matches_oracle(result, tokens, reasons)
    assert all(module.training for module in model.modules())  # the mode is the trainer's, as found
    assert model.is_gradient_checkpointing


def test_control_without_eval_semantics_dropout_changes_the_tokens(monkeypatch):
    model = dropout_model()
    prompts = random_prompts(LENGTHS, seed=10)
    tokens, _ = oracle_batch(model, prompts, BUDGET)
    model.train()
    monkeypatch.setattr(rollout_module, "eval_semantics", lambda model: contextlib.nullcontext())
    result = Rollout(model, config=RolloutConfig(route="aligned", kernels="torch")).generate(prompts, sampling())
    assert mismatches(result.tokens, tokens)


def test_tied_embeddings_stay_tied_and_exact():
    model = build_tiny_model("tiny-gpt2", seed=35)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    prompts = random_prompts(LENGTHS, seed=11)
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    result = Rollout(model, config=RolloutConfig(**ROUTE_CONFIGS["bucketed"])).generate(prompts, sampling())
    assert_matches_oracle(result, tokens, reasons)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("model", [torch.nn.Linear(2, 2), None, 3], ids=["module", "none", "int"])
def test_something_that_is_not_a_causal_lm_is_refused_by_name(model):
    with pytest.raises(TypeError, match=f"model of type {type(model).__name__} is not a Hugging Face causal LM.*PeftModel"):
        Rollout(model)


def test_a_model_name_instead_of_a_model_is_pointed_at_load_model():
    with pytest.raises(TypeError, match=re.escape("model of type str is not a Hugging Face causal LM") + ".*"
                       + re.escape("autobucket.load_model('tiny-qwen2')")):  # fmt: skip
        Rollout("tiny-qwen2")


def test_control_fsdp2_under_inference_mode_fails(monkeypatch):
    """Why the engine picks its autograd mode per model: FSDP2 cannot unshard under inference mode (in a
    forward's own unshard, as without the call's gathering, which unshards under no_grad)."""
    from autobucket.engine.intercept import grad_mode

    model = build_tiny_model("tiny-mistral", seed=36)
    monkeypatch.setattr(grad_mode, "needs_version_counters", lambda model: False)
    monkeypatch.setattr(rollout_module, "is_sharded", lambda model: False)
    with one_process_group():
        wrapped = wrap("fsdp2", model)
        with pytest.raises(RuntimeError, match="version counter"):
            Rollout(wrapped, config=RolloutConfig(route="aligned")).generate(random_prompts([4], seed=1), sampling())


def test_the_compiled_decode_step_on_a_model_in_train_mode_has_eval_semantics():
    """The compiled graph is traced under the no-dropout mode: its steps match the eval-mode oracle."""
    model = dropout_model()
    prompts = random_prompts(LENGTHS[:4], seed=12)
    tokens, _ = oracle_batch(model, prompts, BUDGET, eos_token_id=[])
    model.train()
    sampling = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4, eos_token_id=[])
    result = Rollout(model, config=RolloutConfig(route="aligned", compile=True)).generate(prompts, sampling)
    assert result.profile.compiled_steps > 0, result.profile.compile_fallback
    assert result.tokens == tokens
    assert all(module.training for module in model.modules())


# ------------------------------------------------------------------ adapter state: switch, disable, scale, merge
def _set_second(model) -> contextlib.AbstractContextManager:
    model.set_adapter("second")
    return contextlib.nullcontext()


def _rescale(model) -> contextlib.AbstractContextManager:
    for module in model.modules():
        if hasattr(module, "set_scale"):
            module.set_scale("default", 3.0)
    return contextlib.nullcontext()


ADAPTER_CHANGES = {
    "set_adapter": _set_second,
    "disable_adapter": lambda model: model.disable_adapter(),  # as TRL computes reference logprobs
    "set_scale": _rescale,
    "merge_adapter": lambda model: (model.merge_adapter(), contextlib.nullcontext())[1],
}


def two_adapter_model():
    return lora(lora(build_tiny_model("tiny-llama", seed=32)), "second", seed=1).eval()


def continue_after(change, unkeyed: str | None = None, monkeypatch=None):
    """Turn 1 with the default adapter, `change` (no parameter's version moves), then turn 2 continuing
    every conversation: (turn-2 result, the oracle's tokens for turn 2 under the change). `unkeyed`: the
    negative control, a prefix cache keyed without that part of `weights_version`."""
    from oracles import forget_oracle

    if unkeyed is not None:
        monkeypatch.setattr(f"autobucket.engine.model_access.weight_versions.{unkeyed}", lambda model: ())
    model = two_adapter_model()
    rollout = Rollout(model, config=RolloutConfig(route="aligned", prefix_cache_mb=16))
    greedy = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[])
    first = random_prompts([40, 28, 50], seed=16)
    turn_one = rollout.generate(first, greedy)
    second = [p + t + [7, 8, 9] for p, t in zip(first, turn_one.tokens, strict=True)]
    with change(model):
        forget_oracle(model)
        result = rollout.generate(second, greedy)
        expected, _ = oracle_batch(model, second, BUDGET, eos_token_id=[])
    forget_oracle(model)
    return result, expected


@pytest.mark.parametrize("change", sorted(ADAPTER_CHANGES))
def test_the_prefix_cache_is_never_served_across_an_adapter_change(change):
    """Switching, disabling, rescaling or merging an adapter changes the forward while no parameter's
    version moves (peft merges through `.data`): turn 2 reuses nothing and matches the oracle."""
    result, expected = continue_after(ADAPTER_CHANGES[change])
    assert result.profile.cached_prompt_tokens == 0 and result.profile.prefix_cache_invalidations == 1
    assert result.tokens == expected


def test_control_a_cache_keyed_without_the_adapters_serves_the_other_adapters_kv(monkeypatch):
    result, expected = continue_after(_set_second, unkeyed="adapter_state", monkeypatch=monkeypatch)
    assert result.profile.cached_prompt_tokens > 0
    assert result.tokens != expected, "the oracle did not catch K/V of the other adapter: the test could not fail"


@contextlib.contextmanager
def _steering(model):
    """A trainer's forward hook on the first decoder layer (activation steering) for the block: the K/V of
    every later layer change, no parameter does."""
    first_layer = next(m for name, m in model.named_modules() if name.endswith("layers.0"))
    handle = first_layer.register_forward_hook(steering_hook(model))
    try:
        yield
    finally:
        handle.remove()


def test_the_prefix_cache_is_never_served_across_a_forward_hook():
    """A forward hook added between turns changes every later layer's K/V (the engine's forwards run it):
    turn 2 reuses nothing and matches the oracle with the hook."""
    result, expected = continue_after(_steering)
    assert result.profile.cached_prompt_tokens == 0 and result.profile.prefix_cache_invalidations == 1
    assert result.tokens == expected


@contextlib.contextmanager
def _rotary_rescaled(model):
    """A buffer written in place (the rotary embedding's `inv_freq`, as a context-extension step might):
    every position's K changes, no parameter does."""
    inv_freq = next(buffer for name, buffer in model.named_buffers() if name.endswith("inv_freq"))
    saved = inv_freq.clone()
    inv_freq.mul_(0.5)
    try:
        yield
    finally:
        inv_freq.copy_(saved)


def test_the_prefix_cache_is_never_served_across_a_buffer_write():
    result, expected = continue_after(_rotary_rescaled)
    assert result.profile.cached_prompt_tokens == 0 and result.profile.prefix_cache_invalidations == 1
    assert result.tokens == expected


def test_control_a_cache_keyed_without_the_buffers_serves_the_old_rotary_kv(monkeypatch):
    monkeypatch.setattr(torch.nn.Module, "buffers", lambda self, recurse=True: iter(()))
    result, expected = continue_after(_rotary_rescaled)
    assert result.profile.cached_prompt_tokens > 0
    assert result.tokens != expected, "the oracle did not catch the old rotary K/V: the test could not fail"


@contextlib.contextmanager
def _input_require_grads(model):
    """What TRL's GRPO (gradient checkpointing) and transformers' checkpointing do at every enable: a new
    forward hook on the input embeddings that only sets `requires_grad`; it changes no value."""
    model.enable_input_require_grads()
    yield


@pytest.mark.parametrize("neutral", [True, False], ids=["value-neutral", "control-keyed"])
def test_transformers_require_grads_hooks_keep_the_prefix_cache_and_the_graphs(neutral, monkeypatch):
    """Keyed like any hook, the one `enable_input_require_grads` adds at every call emptied the prefix cache
    between a TRL tool episode's turns (and would give each call a new compiled graph set). Control: the
    same hook not recognised as value-neutral is keyed (no reuse)."""
    from autobucket.engine.compiled.compiled_decode import hooks_epoch
    from autobucket.engine.model_access import weight_versions

    if not neutral:
        monkeypatch.setattr(weight_versions, "_VALUE_NEUTRAL_HOOKS", frozenset())
    result, expected = continue_after(_input_require_grads)
    assert result.tokens == expected
    assert (result.profile.cached_prompt_tokens > 0) is neutral
    model = build_tiny_model("tiny-llama", seed=38)
    before = hooks_epoch(model)
    model.enable_input_require_grads()
    assert (hooks_epoch(model) == before) is neutral


def test_control_a_cache_keyed_without_the_forward_hooks_serves_unhooked_kv(monkeypatch):
    result, expected = continue_after(_steering, unkeyed="forward_state", monkeypatch=monkeypatch)
    assert result.profile.cached_prompt_tokens > 0
    assert result.tokens != expected, "the oracle did not catch unhooked K/V: the test could not fail"


@pytest.mark.parametrize("follow", [True, False])
def test_invariant_packs_follow_merge_adapter(follow, monkeypatch):
    """peft's merge writes the adapter into the base weight through `.data` (no version moves) and then
    skips its LoRA path: packed base weights must be repacked, or the merged model runs as the bare base.
    Oracle: the merged model's function is the unmerged one's (logits to float tolerance), through a
    Rollout's greedy tokens and the trainer's `autobucket.invariant` forward. Control (follow=False): merges
    not followed, the Rollout's packs are stale and its oracle fails; the trainer's scope keeps no copies
    (it reads the live weights), so its oracle holds either way."""
    import autobucket

    if not follow:
        monkeypatch.setattr("autobucket.engine.kernels.packed_linear.PackedLinears.follow_merges", lambda self, merged: None)
    model = two_adapter_model()
    prompts = random_prompts(LENGTHS, seed=9)
    greedy = SamplingConfig(max_new_tokens=BUDGET, eos_token_id=[])
    rollout = Rollout(model, config=RolloutConfig(route="bucketed", kernels="invariant"))
    ids = torch.tensor([prompts[2]])
    with torch.no_grad():
        unmerged_tokens = rollout.generate(prompts, greedy).tokens
        with autobucket.invariant(model):
            unmerged_logits = model(input_ids=ids).logits
        model.merge_adapter()
        merged = rollout.generate(prompts, greedy)
        with autobucket.invariant(model):
            merged_logits = model(input_ids=ids).logits
        with model.disable_adapter():
            bare_logits = model.get_base_model()(input_ids=ids).logits
    close = torch.allclose(merged_logits, unmerged_logits, atol=1e-4)
    assert not torch.allclose(bare_logits, unmerged_logits, atol=1e-2)  # the adapter matters here
    assert close
    if follow:
        assert merged.tokens == unmerged_tokens and merged.profile.packs_made > 0
    else:
        assert merged.tokens != unmerged_tokens


@pytest.mark.parametrize("route", sorted(ROUTE_CONFIGS))
def test_embeddings_resized_after_the_rollout_was_made_take_and_emit_the_new_ids(route):
    """A trainer that adds tokens calls `resize_token_embeddings` on the model it already handed over: the
    next call accepts the new ids and can choose them (the Rollout read the vocabulary once, refused them,
    and its repetition-penalty mask had the old width). Oracle: HF generate on the resized model, the new
    head rows set so greedy picks a new id."""
    from oracles import forget_oracle

    model = build_tiny_model("tiny-qwen2", seed=33)
    rollout = Rollout(model, config=RolloutConfig(**ROUTE_CONFIGS[route]))
    prompts = random_prompts(LENGTHS, seed=10)
    rollout.generate(prompts, sampling())
    old = model.config.vocab_size
    with torch.random.fork_rng(devices=[]):  # the new rows' random init: the same whatever ran before
        torch.manual_seed(0)
        model.resize_token_embeddings(old + 8, mean_resizing=False)
    with torch.no_grad():
        model.get_output_embeddings().weight[old + 5] = 3 * model.get_output_embeddings().weight[7]
    forget_oracle(model)
    prompts = [prompt + [old + 3] for prompt in prompts]
    tokens, reasons = oracle_batch(model, prompts, BUDGET, repetition_penalty=1.3)
    assert any(old + 5 in row for row in tokens), "no new id chosen: the test could not fail"
    penalized = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4, repetition_penalty=1.3)
    assert_matches_oracle(rollout.generate(prompts, penalized), tokens, reasons)


@pytest.mark.parametrize("checked", [True, False])
def test_attention_switched_to_eager_after_the_rollout_was_made_is_refused_under_invariant_kernels(
    checked, monkeypatch
):
    """`Rollout(kernels="invariant")` refuses an eager model when made; a trainer switching the model's
    attention later (`set_attn_implementation`) is refused at the next call with the same ValueError, and
    switching back generates bitwise as before. Control (checked=False): without the per-call check the
    eager attention reads cache columns the invariant kernels never fill, and the call fails or differs."""
    if not checked:
        monkeypatch.setattr(rollout_module, "check_call_settings", lambda model: None)
    model = build_tiny_model("tiny-llama", seed=34)
    rollout = Rollout(model, config=RolloutConfig(route="aligned", kernels="invariant"))
    prompts = random_prompts(LENGTHS, seed=11)
    sampled = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4, temperature=1.0, seed=3, logprobs=True)
    before = rollout.generate(prompts, sampled)
    model.set_attn_implementation("eager")
    try:
        if checked:
            with pytest.raises(ValueError, match=r"attn_implementation='eager'.*switch it back"):
                rollout.generate(prompts, sampled)
        else:
            try:
                eager = rollout.generate(prompts, sampled)
            except RuntimeError:  # NaN logits from the unfilled columns: UnsamplableRows
                pass
            else:
                assert (eager.tokens, eager.logprobs) != (before.tokens, before.logprobs)
    finally:
        model.set_attn_implementation("sdpa")
    after = rollout.generate(prompts, sampled)
    assert (after.tokens, after.logprobs) == (before.tokens, before.logprobs)


def test_a_float16_model_is_refused_by_the_invariant_kernels_when_made_and_at_each_call():
    """The kernels have fp32 and bf16 forms only: an fp16 model is refused with a ValueError naming its
    dtype and the fixes, when the Rollout or the trainer scope is made and at the next call after a
    trainer's `model.half()` (before: a RuntimeError from inside the attention kernel mid-call); back in
    fp32 the Rollout generates bitwise as before."""
    import autobucket

    fix = r"is float16: load it in \(or move it to\) torch.bfloat16 or torch.float32, or use RolloutConfig"
    half = build_tiny_model("tiny-llama", seed=39).half()
    with pytest.raises(ValueError, match=fix):
        Rollout(half, config=RolloutConfig(route="aligned", kernels="invariant"))
    with pytest.raises(ValueError, match=fix), autobucket.invariant(half):
        pass
    model = build_tiny_model("tiny-llama", seed=39)
    rollout = Rollout(model, config=RolloutConfig(route="aligned", kernels="invariant"))
    prompts = random_prompts(LENGTHS, seed=11)
    greedy = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4, eos_token_id=[])
    before = rollout.generate(prompts, greedy).tokens
    model.half()
    with pytest.raises(ValueError, match=fix):
        rollout.generate(prompts, greedy)
    model.float()
    assert rollout.generate(prompts, greedy).tokens == before


@pytest.mark.parametrize("disabled", [True, False])
def test_a_call_inside_the_trainers_autocast_region_computes_in_the_models_dtype(disabled, monkeypatch):
    """A rollout made inside a mixed-precision step (`torch.autocast("cpu", bfloat16)`): every route and
    both kernel sets give the tokens of the model in its own dtype (the oracle, outside autocast), and the
    region is as it was after the call. Control (disabled=False): autocast reaches the continuous-batching
    routes' linears but not their cache, and they leave the oracle."""
    if not disabled:
        monkeypatch.setattr(rollout_module, "without_autocast", lambda device: contextlib.nullcontext())
    model = build_tiny_model("tiny-llama", seed=35)
    prompts = random_prompts(LENGTHS, seed=12)
    greedy = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4, eos_token_id=[])
    tokens, _ = oracle_batch(model, prompts, BUDGET, eos_token_id=[])
    got = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for route in ("ordinary", "aligned", "bucketed"):
            for kernels in ("hf", "invariant"):
                config = RolloutConfig(**ROUTE_CONFIGS[route], kernels=kernels)
                got[route, kernels] = Rollout(model, config=config).generate(prompts, greedy).tokens
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    wrong = [key for key, value in got.items() if value != tokens]
    if disabled:
        assert wrong == []
    else:
        assert ("aligned", "hf") in wrong and ("bucketed", "hf") in wrong


def _first_token_logprob(forward, prompt, token: int) -> float:
    """log p(token | prompt) from one forward (the prepared model's, or its fp32 original under it)."""
    with torch.inference_mode():
        return forward(torch.tensor([list(prompt)])).logits[0, -1].float().log_softmax(-1)[token].item()


def test_accelerates_mixed_precision_forward_is_named_where_the_cb_routes_do_not_follow_it():
    """accelerate's `prepare` with mixed_precision="bf16" (TRL's bf16=True on an fp32 model) wraps
    `model.forward` in autocast. What each path computes, against its oracle: the ordinary route is the
    prepared model's own generate; `kernels="invariant"` is the model in fp32 on every route; the model's own
    ops with the engine's decode attention (the fallback of `kernels="auto"`) on the continuous-batching routes follow the autocast forward in prefill (a first token's logprob is
    the prepared forward's, not the fp32 one's) but attend in fp32 in decode, so their tokens can differ
    from the prepared model's generate (seen on other prompts, not asserted), and say so once (a
    RuntimeWarning naming the fixes)."""
    import warnings

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from autobucket.checks import warn_once

    model = build_tiny_model("tiny-llama", seed=36)
    prompts = random_prompts(LENGTHS, seed=13)
    greedy = SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4, eos_token_id=[])
    fp32_tokens, _ = oracle_batch(model, prompts, BUDGET, eos_token_id=[])
    try:
        prepared = Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
        amp_tokens = hf_greedy(prepared, prompts, BUDGET)
        assert amp_tokens != fp32_tokens, "autocast changed nothing: the test could not fail"
        warn_once.cache_clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # neither of these warns
            ordinary = RolloutConfig(route="ordinary", kernels="torch")
            assert Rollout(prepared, config=ordinary).generate(prompts, greedy).tokens == amp_tokens
            invariant = Rollout(prepared, config=RolloutConfig(route="aligned", kernels="invariant"))
            assert invariant.generate(prompts, greedy).tokens == fp32_tokens
        with pytest.warns(RuntimeWarning, match=r"accelerate's mixed precision.*kernels='invariant'"):
            own_ops = RolloutConfig(route="aligned", kernels="torch", op_backends={"decode_attention": "cpu"})
            aligned = Rollout(prepared, config=own_ops).generate(
                prompts, dataclasses.replace(greedy, logprobs=True)
            )
        assert aligned.logprobs is not None
        first = torch.tensor([row[0] for row in aligned.logprobs])
        amp_first, fp32_first = (
            torch.tensor([_first_token_logprob(forward, p, t[0]) for p, t in zip(prompts, aligned.tokens, strict=True)])
            for forward in (prepared, prepared._original_forward)
        )  # fmt: skip
        torch.testing.assert_close(first, amp_first, rtol=0, atol=1e-5)
        assert (first - fp32_first).abs().max() > 1e-3, "autocast moved no logprob: the check could not fail"
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        warn_once.cache_clear()


def test_the_keys_of_a_replaced_forward_do_not_keep_the_model_alive():
    """accelerate's mixed-precision wrapper is a forward bound to the model: the prefix cache's key and the
    compiled step's per-model hook sets (a weak-keyed table) hold it by weak reference, so a model the
    trainer drops is freed; the key still tells the wrapper from a new one."""
    import gc
    import weakref

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from autobucket.engine.compiled.compiled_decode import hooks_epoch
    from autobucket.engine.model_access.weight_versions import weights_version

    try:
        model = Accelerator(mixed_precision="bf16", cpu=True).prepare(build_tiny_model("tiny-llama", seed=37))
        assert hooks_epoch(model) > 0
        before = weights_version(model)
        assert weights_version(model) == before
        model.forward = type(model.forward)(model.forward.__func__, model)  # the same wrapper bound anew
        assert weights_version(model) != before
        alive = weakref.ref(model)
        del model
        gc.collect()
        assert alive() is None, "a key kept the model alive"
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
