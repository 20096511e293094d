"""The captured decode form (`engine/decode/captured.py`) on its CPU stand-in (`graphs_on_cpu`: the step
traced by make_fx over its persistent buffers, replayed into one output tensor, weights held by storage).

Oracle: the eager engine form of the same call. On the Triton set (forced onto the CPU, Triton's
interpreter) the rollout must equal it bitwise, with rows joining and leaving across row and column
buckets and a prompt's samples that the eager form decodes over one shared copy; on the model's own ops
(transformers' SDPA reads the bucket's masked columns too) up to rounding. Inside one runner: an
in-place weight update is seen by the graphs already captured; a replaced weight tensor, a new hook or
a disabled adapter drops them. A step that cannot be recorded decodes eagerly; a model's error
propagates. Controls that must break: the K/V write column taken as a Python int
(frozen at capture), and a graph kept after its fingerprint changed."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels then run on CPU tensors

import contextlib
import copy

import pytest
import torch
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.engine.batching.model_runner import CacheShape, ModelRunner, RowInsert
from autobucket.engine.decode import captured, graph_buffers
from autobucket.engine.decode.graph_capture import graphs_on_cpu
from autobucket.engine.model_access.hf_compat import forward_spec
from autobucket.engine.plan.forward_plan import choose_plan, plan_entered

pytestmark = [pytest.mark.usefixtures("single_thread")]

LENGTHS = [5, 19, 9, 3]


@pytest.fixture
def small_buckets(monkeypatch):
    """Column buckets of 8: a short call crosses several (the default, 128, needs long prompts)."""
    monkeypatch.setattr(captured, "CAPTURE_COLUMN_STEP", 8)


def rollout(model, prompts, kernels: str, graphs: bool, n: int = 1, new_tokens: int = 16):
    """3 rows at a time (rows finish at different steps and others join) -> (result, captures made)."""
    config = RolloutConfig(
        route="bucketed", kernels=kernels, persist_costs=False, costs=CostCoefficients(),
        cuda_graphs="auto" if graphs else False, prefill_max_tokens=64,
    )  # fmt: skip
    budgets = [new_tokens - (index % 3) * 3 for index in range(len(prompts))]  # rows leave at different steps
    sampling = SamplingConfig(
        max_new_tokens=budgets, temperature=1.0, seed=list(range(len(prompts))), logprobs=True,
        continuous_batch_size=3, eos_token_id=[], n=n,
    )  # fmt: skip
    triton = contextlib.nullcontext()
    if kernels == "invariant":
        pytest.importorskip("triton")
        from autobucket.engine.intercept.triton_set import forced_on_cpu

        triton = forced_on_cpu()
    before = captured.captures_made()
    with triton, graphs_on_cpu() if graphs else contextlib.nullcontext():
        result = Rollout(model, config=config).generate(prompts, sampling)
    return result, captured.captures_made() - before


def test_triton_set_captured_rollout_equals_the_eager_one_bitwise(tiny_models, small_buckets, always_share):
    model = copy.deepcopy(tiny_models("tiny-llama"))
    prompts = random_prompts(LENGTHS, seed=5)
    eager, none = rollout(model, prompts, "invariant", graphs=False, n=2)
    graphs, made = rollout(model, prompts, "invariant", graphs=True, n=2)
    assert eager.profile.plan["decode_step"] == "engine" and none == 0
    assert eager.profile.shared_kv_rows > 0  # the eager form decodes the samples over one shared copy
    assert graphs.profile.plan["decode_step"] == "captured"
    assert graphs.profile.plan["shared_prefix_attention"] == "none"  # the graphs read each row's own copy
    assert made >= 4  # several row and column buckets
    assert graphs.tokens == eager.tokens
    assert graphs.logprobs == eager.logprobs


def test_model_ops_captured_rollout_equals_the_eager_one(tiny_models, small_buckets):
    """The model's own ops: SDPA over a bucket's masked columns rounds differently from SDPA over the
    front's, so tokens are equal and logprobs equal up to rounding."""
    model = copy.deepcopy(tiny_models("tiny-llama"))
    prompts = random_prompts(LENGTHS, seed=5)
    eager, _ = rollout(model, prompts, "torch", graphs=False)
    graphs, made = rollout(model, prompts, "torch", graphs=True)
    assert graphs.profile.plan["decode_step"] == "captured" and made >= 3
    assert graphs.tokens == eager.tokens
    assert _largest_difference(graphs.logprobs, eager.logprobs) < 1e-5


def test_a_step_value_frozen_at_capture_breaks_the_rollout(tiny_models, small_buckets, monkeypatch):
    """Control: the K/V write column as a Python int (the store's front when the graph was captured), as
    an eager step passes it, writes every later step of that graph into one column."""
    model = copy.deepcopy(tiny_models("tiny-llama"))
    prompts = random_prompts(LENGTHS, seed=5)
    eager, _ = rollout(model, prompts, "torch", graphs=False)

    def write_at_captured_front(self, layer, key, value):
        front = self.store.front  # read on the host at capture: frozen into the graph
        self.keys[layer][:, :, front : front + 1] = key
        self.values[layer][:, :, front : front + 1] = value
        return self.keys[layer], self.values[layer]

    monkeypatch.setattr(graph_buffers.StepBuffers, "write", write_at_captured_front)
    frozen, _ = rollout(model, prompts, "torch", graphs=True)
    assert frozen.tokens != eager.tokens


def test_cuda_graphs_setting_is_checked_and_the_plan_says_why_not(tiny_models):
    model = tiny_models("tiny-llama")
    with pytest.raises(ValueError, match="cuda_graphs="):
        RolloutConfig(cuda_graphs="always")
    with pytest.raises(ValueError, match="compile=False, or cuda_graphs='auto'"):
        RolloutConfig(cuda_graphs=True, compile=True)
    plan = choose_plan(model, RolloutConfig(kernels="torch"), None, "bucketed")
    assert plan.decode_step == "engine" and "CUDA graphs need a CUDA device" in plan.decode_step_reason
    with pytest.raises(ValueError, match="cuda_graphs=True.*CUDA graphs need a CUDA device"):
        choose_plan(model, RolloutConfig(kernels="torch", cuda_graphs=True), None, "bucketed")
    with graphs_on_cpu():
        assert choose_plan(model, RolloutConfig(kernels="torch"), None, "bucketed").decode_step == "captured"
        off = choose_plan(model, RolloutConfig(kernels="torch", cuda_graphs=False), None, "bucketed")
        assert off.decode_step == "engine" and "cuda_graphs=False" in off.decode_step_reason
        cpu_set = choose_plan(model, RolloutConfig(kernels="invariant"), None, "bucketed")
        assert cpu_set.decode_step == "engine" and "packed copies" in cpu_set.decode_step_reason


# ------------------------------------------------------------------ one runner, step by step
class Pair:
    """Two runners over the same rows, one eager and one captured, fed the same tokens each step."""

    def __init__(self, model, prompts):
        self.model = model
        config = RolloutConfig(kernels="torch", persist_costs=False, costs=CostCoefficients())
        self.eager = self._runner(model, prompts, config, graphs=False)
        self.graphs = self._runner(model, prompts, config, graphs=True)
        assert self.graphs[0].decode_step == "captured" and self.eager[0].decode_step == "engine"

    @staticmethod
    def _runner(model, prompts, config, graphs):
        with graphs_on_cpu() if graphs else contextlib.nullcontext(), torch.inference_mode():
            plan = choose_plan(model, config, None, "bucketed")
            with plan_entered(plan, model, None):
                runner = ModelRunner(model, forward_spec(model), CacheShape(4, 48), 0, model.config.vocab_size, False)
                output, _ = runner.prefill(prompts)
                first = output.last_logits.argmax(-1)
                runner.insert(output, RowInsert(list(range(len(prompts))), first, [len(p) for p in prompts], None))
        return runner, plan, graphs

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of both -> (eager logits, captured logits); both then feed the eager argmax."""
        logits = []
        for runner, plan, graphs in (self.eager, self.graphs):
            scope = graphs_on_cpu() if graphs else contextlib.nullcontext()
            with scope, torch.inference_mode(), plan_entered(plan, self.model, None):
                runner.prepare_decode()
                logits.append(runner.decode_logits().clone())
        tokens = logits[0].argmax(-1)
        for runner, _, _ in (self.eager, self.graphs):
            runner.advance(tokens)
        return logits[0], logits[1]

    @property
    def stats(self) -> captured.CaptureStats:
        return self.graphs[0].captured.stats


def close(eager: torch.Tensor, graphs: torch.Tensor) -> bool:
    """Equal up to the rounding of SDPA over a bucket's masked columns (logits of magnitude ~10); what the
    controls change moves them by far more."""
    return (eager - graphs).abs().max().item() < 1e-4


@pytest.fixture
def pair(tiny_models):
    model = copy.deepcopy(tiny_models("tiny-llama"))
    return Pair(model, random_prompts([6, 11, 4], seed=2))


def test_an_in_place_weight_update_is_seen_by_the_graphs_already_captured(pair):
    assert close(*pair.step())
    graphs = pair.stats.graphs
    before, _ = pair.step()
    with torch.no_grad():
        for parameter in pair.model.parameters():
            parameter.mul_(1.5)  # an optimizer step: in place
    eager, replayed = pair.step()
    assert pair.stats.graphs == graphs and pair.stats.dropped_graphs == 0  # reused
    assert close(eager, replayed) and not close(before, eager)  # the new weights are seen


def test_a_replaced_weight_tensor_drops_the_graphs(pair, monkeypatch):
    """A weight replaced by a new tensor (`.data =`, `model.to`) has another address: the graphs holding
    the old one are dropped. Control: with the fingerprint blind to it, the old graph reads the old weight."""
    assert close(*pair.step())
    lm_head = pair.model.lm_head
    with torch.no_grad():
        lm_head.weight.data = lm_head.weight.data * 2.0
    assert close(*pair.step())
    assert pair.stats.dropped_graphs > 0
    graphs = pair.stats.graphs
    fingerprint = pair.graphs[0].captured.fingerprint
    monkeypatch.setattr(captured, "graph_fingerprint", lambda model: fingerprint)  # a stale graph kept
    with torch.no_grad():
        lm_head.weight.data = lm_head.weight.data * 2.0
    eager, stale = pair.step()
    assert pair.stats.graphs == graphs and not close(eager, stale)


def test_a_hook_added_between_steps_drops_the_graphs(pair, monkeypatch):
    assert close(*pair.step())
    handle = pair.model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: out + 1.0)
    try:
        eager, replayed = pair.step()
        assert pair.stats.dropped_graphs > 0 and close(eager, replayed)
        fingerprint = pair.graphs[0].captured.fingerprint
        handle.remove()
        monkeypatch.setattr(captured, "graph_fingerprint", lambda model: fingerprint)  # control: kept stale
        eager, stale = pair.step()
        assert not close(eager, stale)  # the graph still runs the removed hook
    finally:
        handle.remove()


def test_disabling_an_adapter_drops_the_graphs(tiny_models):
    peft = pytest.importorskip("peft")
    base = copy.deepcopy(tiny_models("tiny-llama"))
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, config).base_model.model  # the LoRA layers in a plain causal LM
    pair = Pair(model, random_prompts([6, 11, 4], seed=2))
    from peft.tuners.tuners_utils import BaseTunerLayer

    assert close(*pair.step())
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.enable_adapters(False)
    eager, replayed = pair.step()
    assert pair.stats.dropped_graphs > 0 and close(eager, replayed)


def _largest_difference(left, right) -> float:
    flat = lambda values: [x for row in values for x in (row if isinstance(row[0], float) else [y for r in row for y in r])]  # noqa: E731
    return max(abs(a - b) for a, b in zip(flat(left), flat(right), strict=True))


def test_a_step_that_cannot_be_captured_decodes_eagerly_and_model_errors_propagate(tiny_models, monkeypatch):
    """A host read of a device value inside the step fails the recording (as it fails a CUDA capture):
    one warning, the call decodes eagerly, its tokens the eager form's. A model's own error raises at
    the warm-up, unchanged."""
    model = copy.deepcopy(tiny_models("tiny-llama"))
    prompts = random_prompts(LENGTHS, seed=5)
    eager, _ = rollout(model, prompts, "torch", graphs=False)
    real_write = graph_buffers.StepBuffers.write

    def write_after_a_host_read(self, layer, key, value):
        assert int(self.column.item()) == self.store.front  # a host read: fine eagerly, not in a graph
        return real_write(self, layer, key, value)

    monkeypatch.setattr(graph_buffers.StepBuffers, "write", write_after_a_host_read)
    with pytest.warns(RuntimeWarning, match="CUDA-graph decode off for this call.*reads a device value on the host"):
        fallen_back, made = rollout(model, prompts, "torch", graphs=True)
    assert made == 0 and fallen_back.tokens == eager.tokens and fallen_back.logprobs == eager.logprobs
    monkeypatch.setattr(graph_buffers.StepBuffers, "write", real_write)

    class ModelError(Exception):
        pass

    def raise_in_decode(module, args):
        if args[0].shape[1] == 1:  # one token per row: a decode step
            raise ModelError("raised by the model")

    handle = model.model.layers[1].self_attn.q_proj.register_forward_pre_hook(raise_in_decode)
    try:
        with pytest.raises(ModelError, match="raised by the model"):
            rollout(model, prompts, "torch", graphs=True)
    finally:
        handle.remove()
