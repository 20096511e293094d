"""What a trainer does around `autobucket.invariant(model)` that the zero-mismatch oracle must survive.

Position ids: a trainer scores the rollout with only `input_ids` and `attention_mask` (TRL's
`_get_per_token_logps_and_entropies`); inside the scope the forward still gives every sampled token's
rollout logprob bitwise. Negative controls: the same forward outside the scope, and inside it with the
scope's position ids taken out, differ.

Compiled models: a `torch.compile`d module (wrapper, submodule, or compiled in place) is refused by
name with the module to pass instead, and the scope serves that module afterwards. Control: what the
refusal prevents, a compiled forward in the scope, differs from the rollout.

Weight writes: after any write to the weights (through `.data` included, which no version counter
sees), the next scoped forward is bitwise a fresh copy's scoped forward and close to the plain forward.
Control: a scope that keeps packed copies serves the old weights after a `.data` write.

Oracle throughout: a `Rollout(kernels="invariant")` sampling at temperature 1 with logprobs, or the
model's own forward with explicit position ids."""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
from test_zero_mismatch import DTYPES, max_abs_diff, model_in, sample
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, invariant, trainer_logprobs
from autobucket.engine.batching.prefill import positions_from_mask
from autobucket.engine.intercept import trainer as trainer_scope
from autobucket.engine.intercept import trainer_positions
from autobucket.engine.trainer_logprobs import teacher_forced_batch

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.engine]


def logprobs_without_positions(model, prompts, completions, scoped: bool) -> torch.Tensor:
    """TRL's scoring forward: one padded batch, input ids and mask only -> logprobs [rows, C]."""
    ids, mask, width = teacher_forced_batch(prompts, completions)
    with invariant(model) if scoped else contextlib.nullcontext():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return trainer_logprobs(logits[:, width - 1 : -1], ids[:, width:]).detach().float()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded rows and one without padding: ids and mask [3, 20]."""
    ids = torch.tensor(random_prompts([20, 20, 20], seed=7))
    mask = torch.ones_like(ids)
    mask[0, :6], mask[1, :13] = 0, 0
    return ids, mask


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2", "tiny-gpt2", "tiny-opt"])
def test_a_scoped_forward_without_position_ids_gives_the_rollout_logprobs_bitwise(arch, dtype, tiny_models):
    """Rotary (Llama, Qwen2) and learned absolute positions (GPT-2 counts from column 0 by itself; OPT
    counts over the mask by itself, so it has no control)."""
    model = model_in(arch, dtype, tiny_models)
    prompts, completions, logprobs = sample(model, "invariant", "bucketed", 16, 1)
    assert max_abs_diff(logprobs_without_positions(model, prompts, completions, True), completions, logprobs) == 0.0
    if arch != "tiny-opt":  # controls: HF counts this row's positions from column 0
        unscoped = logprobs_without_positions(model, prompts, completions, False)
        assert max_abs_diff(unscoped, completions, logprobs) > 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_control_the_scope_without_its_position_ids_differs(dtype, tiny_models, monkeypatch):
    monkeypatch.setattr(trainer_positions, "count_positions_over_real_tokens", lambda module, args, kwargs: None)
    model = model_in("tiny-qwen2", dtype, tiny_models)
    prompts, completions, logprobs = sample(model, "invariant", "bucketed", 16, 1)
    assert max_abs_diff(logprobs_without_positions(model, prompts, completions, True), completions, logprobs) > 0.0


def test_positions_reach_the_model_through_a_peft_wrapper_and_positional_arguments(tiny_models):
    """A LoRA PeftModel called as `model(ids, mask)`: the forward equals the one given position ids."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(tiny_models("tiny-llama")), config)
    ids, mask = padded_batch()
    with torch.no_grad(), invariant(model):
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        positional = model(ids, mask).logits
    assert torch.equal(positional[mask.bool()], expected[mask.bool()])


def test_given_position_ids_and_unpadded_masks_are_left_as_they_are(tiny_models):
    """Column positions passed explicitly stay column positions; a mask without padding before real
    tokens changes nothing (the forward equals the one given column positions). GPT-2: its learned
    positions make a wrong count visible beyond rounding (rotary scores depend on distances only)."""
    model = model_in("tiny-gpt2", torch.float32, tiny_models)
    ids, mask = padded_batch()
    columns = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        plain_columns = model(input_ids=ids, attention_mask=mask, position_ids=columns).logits
        with invariant(model):
            scoped_columns = model(input_ids=ids, attention_mask=mask, position_ids=columns).logits
            scoped_counted = model(input_ids=ids, attention_mask=mask).logits
            right_padded = model(input_ids=ids, attention_mask=mask.flip(-1)).logits
            right_columns = model(input_ids=ids, attention_mask=mask.flip(-1), position_ids=columns).logits
    real = mask.bool()
    assert not torch.allclose(scoped_columns[real], scoped_counted[real], atol=1e-2)  # the control: counts differ
    torch.testing.assert_close(scoped_columns, plain_columns, rtol=1e-4, atol=1e-5)
    assert torch.equal(right_padded, right_columns)


def test_a_cached_forward_counts_its_positions_over_the_whole_mask(tiny_models):
    """A prefill then one step with the cache, neither given position ids: the step's logits equal those
    of one forward over the whole sequence with positions counted over real tokens."""
    model = model_in("tiny-gpt2", torch.float32, tiny_models).eval()
    ids, mask = padded_batch()

    def last_step() -> torch.Tensor:
        prefix = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        return model(input_ids=ids[:, -1:], attention_mask=mask, past_key_values=prefix.past_key_values).logits[:, -1]

    with torch.no_grad():
        with invariant(model):
            whole = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits[:, -1]
            step = last_step()
        unscoped = last_step()  # the control: HF's own count, from column 0
    torch.testing.assert_close(step, whole, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(unscoped[:2], whole[:2], atol=1e-2)


def test_another_threads_forward_and_the_model_are_untouched(tiny_models):
    """While a scope is open, another thread's forward without position ids counts columns as HF does
    (bitwise the unscoped forward) while this thread's counts real tokens; after the block the model
    has no hook left."""
    model = model_in("tiny-gpt2", torch.float32, tiny_models)
    ids, mask = padded_batch()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        counted = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        seen = {}
        with invariant(model):
            scoped = model(input_ids=ids, attention_mask=mask).logits
            thread = threading.Thread(target=lambda: seen.update(logits=model(input_ids=ids, attention_mask=mask).logits))
            thread.start()
            thread.join()
    assert torch.equal(seen["logits"], plain)
    real = mask.bool()
    torch.testing.assert_close(scoped[real], counted[real], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(scoped[real], plain[real], atol=1e-2)
    assert not model._forward_pre_hooks and not model._forward_pre_hooks_with_kwargs


@pytest.mark.parametrize(("compile_", "message"), [
    (torch.compile, r"the model passed \(OptimizedModule\) is one .*pass the module it wraps \(model._orig_mod\)"),
    (lambda model: model.compile() or model, r"the model passed \(LlamaForCausalLM\) was compiled in place"),
    (lambda model: setattr(model.model.layers, "0", torch.compile(model.model.layers[0])) or model,
     r"submodule 'model.layers.0' is one .*model.get_submodule\('model.layers.0'\)._orig_mod in its place"),
], ids=["wrapper", "in-place", "submodule"])  # fmt: skip
def test_a_compiled_model_is_refused_naming_what_to_pass(compile_, message, tiny_models):
    model = model_in("tiny-llama", torch.float32, tiny_models)
    compiled = compile_(copy.deepcopy(model))
    with pytest.raises(ValueError, match=message), invariant(compiled):
        pytest.fail("the block ran")
    prompts, completions, logprobs = sample(model, "invariant", "bucketed", 16, 1)  # the scope still serves
    assert max_abs_diff(logprobs_without_positions(model, prompts, completions, True), completions, logprobs) == 0.0


def test_the_module_a_compiled_wrapper_holds_keeps_the_guarantee_and_the_compiled_forward_would_not(
    tiny_models, monkeypatch
):
    """`._orig_mod`, as the refusal says, in the scope: bitwise the rollout's logprobs. Control: the
    compiled forward itself in the scope (the check taken out) runs other linears and differs (the
    eager backend: dynamo's graph, without inductor's compile time)."""
    model = model_in("tiny-llama", torch.float32, tiny_models)
    compiled = torch.compile(model, backend="eager")
    prompts, completions, logprobs = sample(model, "invariant", "bucketed", 16, 1)
    held = logprobs_without_positions(compiled._orig_mod, prompts, completions, True)
    assert max_abs_diff(held, completions, logprobs) == 0.0
    monkeypatch.setattr(trainer_scope, "check_not_compiled", lambda model: None)
    ids, mask, width = teacher_forced_batch(prompts, completions)
    with torch.no_grad(), invariant(compiled):
        logits = compiled(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    traced = trainer_logprobs(logits[:, width - 1 : -1], ids[:, width:]).float()
    assert max_abs_diff(traced, completions, logprobs) > 0.0


def _step(model, target) -> None:
    """One SGD step that moves every parameter (lr 1: the gradient of 0.5 |p - target|^2 is p - target)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    sum(0.5 * (p - t).square().sum() for p, t in zip(model.parameters(), target.parameters(), strict=True)).backward()
    optimizer.step()


def _assign(model, target) -> None:
    for p, t in zip(model.parameters(), target.parameters(), strict=True):
        p.data = t.detach().clone()


def _copy_under_no_grad(model, target) -> None:
    with torch.no_grad():
        for p, t in zip(model.parameters(), target.parameters(), strict=True):
            p.copy_(t)


# each moves the model's weights to other values (`target`'s, or a scaling)
WRITES = {
    "data.copy_": lambda model, target: [
        p.data.copy_(t) for p, t in zip(model.parameters(), target.parameters(), strict=True)],
    "data.mul_": lambda model, target: [p.data.mul_(1.5) for p in model.parameters()],
    "data = t": _assign,
    "optimizer step": _step,
    "copy_ under no_grad": _copy_under_no_grad,
    "load_state_dict": lambda model, target: model.load_state_dict(target.state_dict()),
    "vector_to_parameters": lambda model, target: torch.nn.utils.vector_to_parameters(
        torch.nn.utils.parameters_to_vector(target.parameters()).detach().clone(), model.parameters()),
}  # fmt: skip


def other_weights(model):
    """A copy of `model` with every weight scaled by -0.75 (its logits far from the model's)."""
    target = copy.deepcopy(model)
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(-0.75)
    return target


def scoped_logits(model, ids, mask) -> torch.Tensor:
    """The trainer's forward in the scope, with autograd on (as a loss forward runs)."""
    with invariant(model):
        return model(input_ids=ids, attention_mask=mask).logits.detach()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("write", sorted(WRITES))
def test_every_weight_write_reaches_the_next_scoped_forward(write, dtype, tiny_models):
    """Weights used once in the scope (where copies would be made), then written: the next scoped forward
    is bitwise a fresh copy's (a model the scope never saw) and close to the plain forward."""
    model = model_in("tiny-qwen2", dtype, tiny_models)
    target = other_weights(model)
    ids, mask = padded_batch()
    before = scoped_logits(model, ids, mask)
    WRITES[write](model, target)
    model.zero_grad(set_to_none=True)
    after = scoped_logits(model, ids, mask)
    real = mask.bool()
    assert not torch.allclose(after[real].float(), before[real].float(), atol=0.1)  # the write matters
    assert torch.equal(after, scoped_logits(copy.deepcopy(model), ids, mask))
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    # another kernel's rounding, relative to the logits' scale (bf16 keeps 8 bits of mantissa)
    tolerance = (1e-5 if dtype == torch.float32 else 3e-2) * plain[real].abs().max().item()
    torch.testing.assert_close(after[real].float(), plain[real].float(), rtol=0, atol=tolerance)


@pytest.mark.parametrize("write", ["data.copy_", "data.mul_"])
def test_control_a_scope_keeping_packed_copies_serves_the_old_weights(write, tiny_models, monkeypatch):
    """The failure the live reads rule out: with copies kept (no budget), a `.data` write leaves the next
    scoped forward's linears on the old weights, even after `Rollout.refresh_weights()`: it is not a
    fresh copy's forward."""
    monkeypatch.setattr(trainer_scope, "LIVE_WEIGHTS_BYTES", None)
    model = model_in("tiny-qwen2", torch.float32, tiny_models)
    rollout = Rollout(model, config=RolloutConfig(kernels="invariant"))
    ids, mask = padded_batch()
    before = scoped_logits(model, ids, mask)
    WRITES[write](model, other_weights(model))
    rollout.refresh_weights()
    after = scoped_logits(model, ids, mask)
    assert not torch.equal(after, before)  # embeddings and norms are read live either way
    assert not torch.allclose(after, scoped_logits(copy.deepcopy(model), ids, mask), atol=0.1)
