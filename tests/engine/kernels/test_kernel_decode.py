"""The engine's decode step on the kernels straight (`engine/decode/ops.py`, `kernel_ops`) against the
oracle it stands in for: the same step on the model's modules (the direct step), itself tested bitwise against the model's forward (test_direct_decode.py), on the
same static cache, kernels and state. Logits and every layer's written K/V must be bitwise equal on each
Llama-family architecture in fp32 with a padding mask, and in cascade steps over shared prompts; where the step cannot be exact (bf16, no invariant
kernels, a hook to run, a weight to repack, a LoRA layer) it must decline, and the direct step's values
come back. Negative control: the step reading panels without their weight version serves the weights as
they were before an update, which the comparison must catch."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
import transformers
from windowed_models import windowed_model
from workloads import random_prompts

from autobucket.engine.batching.model_runner import CacheShape, ModelRunner, RowInsert
from autobucket.engine.decode import eligibility
from autobucket.engine.decode import ops as decode_ops
from autobucket.engine.intercept.attention import sliding_windows_applied
from autobucket.engine.intercept.elementwise import fused_elementwise
from autobucket.engine.intercept.kernel_sets import invariant_kernels
from autobucket.engine.kernels.packed_linear import PackedLinears
from autobucket.engine.model_access.hf_compat import forward_spec
from autobucket.models import build_tiny_model

pytestmark = [
    pytest.mark.engine,
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(
        not eligibility.installed_release_verified(),
        reason=f"the direct step is off on transformers {transformers.__version__} (not yet checked on it)",
    ),
]

FAMILY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")
PADDED_LENGTHS = (7, 19, 3, 12, 30)
STEPS = 3


@pytest.fixture
def kernels_built():
    """The kernel step needs the fixed-order linear and the fused SiLU-and-multiply of this CPU's width
    (AVX-512 or AVX2 builds); elsewhere it always declines, which the tests of declining still check."""
    from autobucket.engine.kernels.elementwise import gated_mlp
    from autobucket.engine.kernels.packed_matmul import fixed_order_op

    if fixed_order_op() is None or not gated_mlp.available():
        pytest.skip("no vector build of the fixed-order linear and the fused SiLU here: the direct step runs")


def filled_runner(model, lengths=PADDED_LENGTHS) -> ModelRunner:
    prompts = random_prompts(lengths, seed=len(lengths))
    runner = ModelRunner(model, forward_spec(model), CacheShape(len(lengths), max(lengths) + STEPS + 2), 0,
                         model.config.vocab_size, track_seen=False)  # fmt: skip
    output, _ = runner.prefill(prompts)
    runner.insert(output, RowInsert(list(range(len(lengths))), output.last_logits.argmax(-1), list(lengths), None))
    return runner


def shared_runner(model) -> ModelRunner:
    """Three prompts' samples admitted together, 3, 2 and 1 rows: each of the first two prompts' rows read
    one shared copy of its K/V (cascade decode); every row starts from a token of its own, so they differ."""
    lengths, source_rows = (70, 19, 30), [0, 0, 0, 1, 1, 2]  # 70: a whole 64-key block, the group's tile
    prompts = random_prompts(lengths, seed=3)
    runner = ModelRunner(model, forward_spec(model), CacheShape(len(source_rows), max(lengths) + STEPS + 2), 0,
                         model.config.vocab_size, track_seen=False, shared_prefix=True, samples_share_prompt=True)  # fmt: skip
    output, _ = runner.prefill(prompts)
    first_tokens = torch.tensor([5, 9, 13, 7, 2, 11])
    runner.insert(output, RowInsert(source_rows, first_tokens, [lengths[s] for s in source_rows], None))
    assert len(runner.store.shared_prefixes) == 2
    return runner


def engine_scope(model, packs: PackedLinears) -> ExitStack:
    """The scopes a rollout with kernels="invariant" runs its decode steps in."""
    stack = ExitStack()
    stack.enter_context(torch.inference_mode())
    stack.enter_context(invariant_kernels(packs))
    stack.enter_context(fused_elementwise(model))
    return stack


class Taken:
    """Counts the steps whose kernel ops were taken (`kernel_ops` returned them) and declined."""

    def __init__(self, monkeypatch) -> None:
        self.taken = self.declined = 0
        kernel_ops = decode_ops.kernel_ops

        def counting(*args):
            ops = kernel_ops(*args)
            if ops is None:
                self.declined += 1
            else:
                self.taken += 1
            return ops

        monkeypatch.setattr(decode_ops, "kernel_ops", counting)


def step_both_ways(runner: ModelRunner):
    """One decode step at the same front with the kernel ops allowed, then with only the module ops (the
    direct step) -> (logits, written K/V) of each; the runner then advances with the direct step's tokens."""
    results, front = [], runner.store.front
    for kernels_allowed in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            if not kernels_allowed:
                patch.setattr(decode_ops, "kernel_ops", lambda *args: None)
            runner.prepare_decode()
            logits = runner.decode_logits()
        written = [t[: runner.active_rows, :, front].clone() for t in (*runner.store.keys, *runner.store.values)]
        results.append((logits, written))
        runner.store.front = front
    runner.store.front = front + 1
    runner.advance(results[1][0].argmax(-1))
    return results


def pack_in_a_direct_step(runner: ModelRunner) -> None:
    """One step, then back to its front: the first step packs every linear (the direct step runs it), so
    the kernel step can take the next ones."""
    runner.prepare_decode()
    runner.decode_logits()
    runner.store.front -= 1


def assert_kernel_step_equals_direct(runner: ModelRunner, steps: int = STEPS) -> None:
    for step in range(steps):
        (kernel_logits, kernel_kv), (direct_logits, direct_kv) = step_both_ways(runner)
        assert torch.equal(kernel_logits, direct_logits), f"step {step}: logits differ"
        for layer, (ours, theirs) in enumerate(zip(kernel_kv, direct_kv, strict=True)):
            assert torch.equal(ours, theirs), f"step {step}: K/V {layer} differs"


@pytest.mark.parametrize("name", FAMILY)
@pytest.mark.usefixtures("kernels_built")
def test_the_kernel_step_is_bitwise_the_direct_step(tiny_models, name, monkeypatch):
    model = tiny_models(name)
    runner = filled_runner(model)
    assert runner.parts is not None
    counter = Taken(monkeypatch)
    with engine_scope(model, PackedLinears()):
        pack_in_a_direct_step(runner)
        assert_kernel_step_equals_direct(runner)
    assert counter.taken == STEPS and counter.declined == 1


@pytest.mark.parametrize("name", ("tiny-llama", "tiny-qwen3"))
@pytest.mark.usefixtures("kernels_built")
def test_a_cascade_step_is_bitwise_the_direct_step(tiny_models, name, monkeypatch):
    """Rows reading shared prompts (the GRPO-like call's every step): the kernel step calls the cascade's
    invariant kernel on the step's layout itself, and its logits and written K/V are the direct step's,
    which runs the cascade through the model's attention interface."""
    model = tiny_models(name)
    runner = shared_runner(model)
    counter = Taken(monkeypatch)
    with engine_scope(model, PackedLinears()):
        pack_in_a_direct_step(runner)
        assert_kernel_step_equals_direct(runner)
    assert counter.taken == STEPS and counter.declined == 1


@pytest.mark.parametrize("cascade", [False, True], ids=["own rows", "cascade"])
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
@pytest.mark.usefixtures("kernels_built")
def test_a_step_past_a_sliding_window_is_bitwise_the_direct_step(name, cascade, monkeypatch):
    """A call past the model's 16-token window: each sliding layer's allowed keys narrowed as the
    dispatcher narrows the direct step's mask (Mistral: every layer; Qwen2: the first of two), and in a
    cascade step its rows read the shared prompt's keys their window covers (prompts of 19-70 tokens)."""
    model = windowed_model(name)
    runner = shared_runner(model) if cascade else filled_runner(model)
    counter = Taken(monkeypatch)
    with engine_scope(model, PackedLinears()), sliding_windows_applied():
        pack_in_a_direct_step(runner)
        assert_kernel_step_equals_direct(runner)
    assert counter.taken == STEPS and counter.declined == 1


def test_the_kernel_step_declines_where_it_cannot_be_exact_and_the_direct_step_runs(tiny_models, monkeypatch):
    model = tiny_models("tiny-llama")
    counter = Taken(monkeypatch)
    runner = filled_runner(model)
    with torch.inference_mode(), invariant_kernels(PackedLinears()):  # no fused elementwise scope
        assert_kernel_step_equals_direct(runner, steps=1)
    with torch.inference_mode():  # the default kernels: no packs
        assert_kernel_step_equals_direct(runner, steps=1)
    assert counter.taken == 0 and counter.declined == 2

    packs, seen, runner = PackedLinears(), [], filled_runner(model)
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *args: seen.append(1))
    try:
        with engine_scope(model, packs):
            assert_kernel_step_equals_direct(runner, steps=2)
    finally:
        handle.remove()
    assert counter.taken == 0 and len(seen) == 4  # the hook ran in every step, both ways

    bf16 = build_tiny_model("tiny-llama").to(torch.bfloat16)
    with engine_scope(bf16, PackedLinears()):
        assert_kernel_step_equals_direct(filled_runner(bf16), steps=2)
    assert counter.taken == 0


@pytest.mark.usefixtures("kernels_built")
def test_after_a_weight_update_the_direct_step_repacks_once_then_the_kernel_step_serves_the_new_weights(
    monkeypatch,
):
    model = build_tiny_model("tiny-qwen2", seed=7)
    packs, counter = PackedLinears(), Taken(monkeypatch)
    runner = filled_runner(model)
    with engine_scope(model, packs):
        assert_kernel_step_equals_direct(runner, steps=2)
    taken = counter.taken
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    with engine_scope(model, packs):
        assert_kernel_step_equals_direct(runner, steps=2)
    assert counter.taken - taken == 1  # the first step after the update ran the direct step (and repacked)


def test_the_kernel_step_declines_a_lora_model():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = peft.get_peft_model(build_tiny_model("tiny-qwen2", seed=5), config).eval().get_base_model()
    runner = filled_runner(model)
    with engine_scope(model, PackedLinears()):
        runner.prepare_decode()
        assert decode_ops.kernel_ops(runner.parts, runner.store.step_mask()) is None


@pytest.mark.usefixtures("kernels_built")
def test_control_a_kernel_step_blind_to_weight_versions_serves_the_old_weights(monkeypatch):
    model = build_tiny_model("tiny-qwen2", seed=7)
    packs = PackedLinears()
    runner = filled_runner(model)
    with engine_scope(model, packs):
        assert_kernel_step_equals_direct(runner, steps=1)

    class VersionBlind:  # the kernel step's view of the packs: the panels last made, whatever the version
        def ready_panels(self, weight):
            pack = packs._packs.get(id(weight))
            return pack.packed if pack is not None and pack.fixed_order else None

    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    # (the direct step keeps the real packs, so it repacks and computes with the updated weight)
    monkeypatch.setattr(decode_ops, "current_packs", lambda: VersionBlind())
    with engine_scope(model, packs), pytest.raises(AssertionError, match="differ"):
        assert_kernel_step_equals_direct(runner, steps=1)


@pytest.mark.usefixtures("kernels_built")
def test_control_a_cascade_step_blind_to_the_shared_prompts_differs(tiny_models, monkeypatch):
    """The kernel step attending to each row's own columns only (the shared prompt's keys left out) must
    fail the comparison with the direct step: the cascade test can tell."""
    model = tiny_models("tiny-llama")
    runner = shared_runner(model)
    with engine_scope(model, PackedLinears()):
        pack_in_a_direct_step(runner)
        def without_shared(calls, *args):
            calls.layout.calls += 1  # counted as the runner checks, so only the values can differ
            return calls.attention(*args)

        monkeypatch.setattr(decode_ops._KernelCalls, "shared_prefix_attention", without_shared)
        with pytest.raises(AssertionError, match="logits differ"):
            assert_kernel_step_equals_direct(runner, steps=1)
