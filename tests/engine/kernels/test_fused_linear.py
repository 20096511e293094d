"""`kernels="invariant"`: bf16 linears that read one input run as one GEMM (`fused_linear.py`).

Oracles: the same forward on unfused packs (bitwise: fusing must never change a value, since the
trainer's scope runs the linears unfused), the model's own module structure (which weights read one
input: q/k/v, gate/up, LoRA's `lora_A`), and `F.linear` for a call whose group is given up. Negative
controls: a fusion that hands a member another member's columns fails the bitwise oracle, and the
probe refuses a fused GEMM whose columns differ from the members' own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autobucket.engine.intercept.kernel_sets import invariant_kernels
from autobucket.engine.kernels import fused_linear, onednn_probes, packed_linear
from autobucket.engine.kernels.fused_linear import LinearFusion
from autobucket.engine.kernels.onednn_probes import (
    bf16_blocks_invariant,
    fused_columns_agree,
    onednn_available,
)
from autobucket.engine.kernels.packed_linear import PackedLinears
from autobucket.models import build_tiny_model
from autobucket.prompts import random_prompts

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(not onednn_available(torch.float32), reason="no oneDNN on this torch build"),
]

BF16_GEMM = onednn_available(torch.bfloat16) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_bf16_gemm = pytest.mark.skipif(
    not BF16_GEMM, reason="no native oneDNN bf16 GEMM on this CPU (bf16 packs run fp32 GEMMs, which are not fused)"
)
# (K, member widths, bias) of the tiny models' groups: q/k/v (qwen2's with biases), gate/up, LoRA's
FUSED_SHAPES = [(64, (64, 32, 32), False), (64, (64, 32, 32), True), (64, (128, 128), False),
                (64, (8, 8), False), (64, (128, 128, 8), False), (32, (16, 8), False)]  # fmt: skip


def _fusion_agrees_here() -> bool:
    """Whether this CPU's probes let the tiny models' groups fuse (where they do not, nothing fuses)."""
    return BF16_GEMM and all(
        fused_columns_agree(k, widths, bias) and all(bf16_blocks_invariant(k, n) for n in (*widths, sum(widths)))
        for k, widths, bias in FUSED_SHAPES
    )


needs_fusion = pytest.mark.skipif(
    not _fusion_agrees_here(), reason="this CPU's fused bf16 GEMM differs from its members' on the tiny shapes"
)


def bf16_model(arch: str) -> torch.nn.Module:
    return build_tiny_model(arch).to(torch.bfloat16).eval()


def batch(model, lengths=(5, 11, 3)) -> dict:
    """A left-padded batch of random prompts: the model's forward keyword arguments."""
    prompts = random_prompts(list(lengths), model.config.vocab_size, seed=3)
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def logits_on(model, packs: PackedLinears, forwards: int = 2) -> torch.Tensor:
    """The last of `forwards` forwards' logits on `packs` (fusion learns in the first)."""
    for _ in range(forwards):
        with invariant_kernels(packs):
            logits = model(**batch(model)).logits
    return logits


def grouped_weights(packs: PackedLinears) -> list[tuple[int, ...]]:
    assert packs.fusion is not None
    return [tuple(id(ref()) for ref in group.weights) for group in packs.fusion.groups]


@needs_fusion
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])  # qwen2: q/k/v with biases
def test_the_linears_reading_one_input_are_fused_and_no_value_changes(arch):
    model = bf16_model(arch)
    fused, unfused = PackedLinears(fuse=True), PackedLinears()
    assert torch.equal(logits_on(model, fused), logits_on(model, unfused))
    expected = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        expected += [tuple(id(p.weight) for p in (attention.q_proj, attention.k_proj, attention.v_proj))]
        expected += [(id(mlp.gate_proj.weight), id(mlp.up_proj.weight))]
    assert grouped_weights(fused) == expected
    assert fused.fusion is not None and fused.fusion.fused_calls == 2 * len(model.model.layers)
    assert fused.nbytes == unfused.nbytes  # the fused copy replaces the members' own


def test_fp32_linears_are_not_fused():
    model = build_tiny_model("tiny-llama").eval()
    packs = PackedLinears(fuse=True)
    logits_on(model, packs)
    assert packs.fusion is not None and packs.fusion.fused_calls == 0 and packs.fusion.groups == []


@needs_fusion
def test_one_forward_runs_fewer_gemms(monkeypatch):
    model = bf16_model("tiny-llama")
    fused, unfused = PackedLinears(fuse=True), PackedLinears()
    logits_on(model, fused), logits_on(model, unfused)
    calls = []
    real = packed_linear.packed_matmul
    monkeypatch.setattr(packed_linear, "packed_matmul", lambda *args: calls.append(1) or real(*args))
    counts = []
    for packs in (unfused, fused):
        calls.clear()
        logits_on(model, packs, forwards=1)
        counts.append(len(calls))
    layers = len(model.model.layers)
    assert counts == [7 * layers + 1, 4 * layers + 1]  # q, k, v, o, gate, up, down + head; fused q/k/v, gate/up


@needs_fusion
def test_control_a_fusion_handing_out_the_wrong_columns_fails_the_oracle(monkeypatch):
    model = bf16_model("tiny-llama")
    reference = logits_on(model, PackedLinears())
    real = LinearFusion.hand_out

    def swapped(self, group, x, fused):  # k gets v's columns and v k's: same shapes, wrong values
        first = real(self, group, x, fused)
        columns = self._handed
        if len(group.out_features) == 3:
            (k, entry_k), (v, entry_v) = list(columns.items())[-2:]
            columns[k].columns, columns[v].columns = entry_v.columns, entry_k.columns
        return first

    monkeypatch.setattr(LinearFusion, "hand_out", swapped)
    assert not torch.equal(logits_on(model, PackedLinears(fuse=True)), reference)


@needs_fusion
def test_the_probe_refuses_a_fused_gemm_whose_columns_differ(monkeypatch):
    probe = fused_columns_agree.__wrapped__  # uncached
    assert probe(64, (64, 32, 32), True)
    real = onednn_probes.onednn_linear

    def off_by_an_ulp_when_fused(rows, packed, bias):
        out = real(rows, packed, bias)
        return torch.nextafter(out, out + 1) if out.shape[-1] == 128 else out

    monkeypatch.setattr(onednn_probes, "onednn_linear", off_by_an_ulp_when_fused)
    assert not probe(64, (64, 32, 32), True)


@needs_bf16_gemm
def test_a_group_the_probe_refuses_runs_unfused_and_is_given_up(monkeypatch):
    model = bf16_model("tiny-llama")
    reference = logits_on(model, PackedLinears())
    monkeypatch.setattr(packed_linear, "fused_columns_agree", lambda *args: False)
    packs = PackedLinears(fuse=True)
    assert torch.equal(logits_on(model, packs), reference)
    assert packs.fusion is not None and packs.fusion.groups == [] and packs.fusion.fused_calls == 0


@needs_fusion
def test_a_members_update_repacks_the_group():
    model = bf16_model("tiny-qwen2")
    packs = PackedLinears(fuse=True)
    logits_on(model, packs)
    made = packs.packs_made
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # a member, not the group's first weight
        model.model.layers[1].self_attn.v_proj.bias.add_(0.25)  # a member's bias
    updated = logits_on(model, packs, forwards=1)
    assert packs.packs_made == made + 2
    assert torch.equal(updated, logits_on(model, PackedLinears()))


@needs_fusion
@torch.no_grad()
def test_a_member_called_on_another_input_runs_its_own_gemm_and_breaks_the_group():
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randn(6, 32, generator=generator).bfloat16() for _ in range(2))
    w1, w2 = torch.randn(16, 32, generator=generator).bfloat16(), torch.randn(8, 32, generator=generator).bfloat16()
    packs = PackedLinears(fuse=True)
    with packed_linear.packed_linears(packs):
        packs.linear(x, w1, None), packs.linear(x, w2, None)  # learned: w1 and w2 read one input
    with packed_linear.packed_linears(packs):
        first = packs.linear(x, w1, None)  # the fused GEMM
        second = packs.linear(y, w2, None)  # another input: its own GEMM
    assert torch.equal(first, PackedLinears().linear(x, w1, None))
    assert torch.equal(second, PackedLinears().linear(y, w2, None))
    torch.testing.assert_close(second, F.linear(y, w2), rtol=2e-2, atol=2e-2)
    assert packs.fusion is not None and packs.fusion.groups == [] and packs.fusion.fused_calls == 1


@needs_bf16_gemm
def test_forwards_done_lets_go_of_the_activations():
    packs = PackedLinears(fuse=True)
    x = torch.randn(4, 32).bfloat16()
    with packed_linear.packed_linears(packs), torch.no_grad():
        packs.linear(x, torch.randn(16, 32).bfloat16(), None)
    assert packs.fusion is not None and packs.fusion._recent == {} and packs.fusion._handed == {}
    assert fused_linear.RECENT_INPUTS >= 3  # q, k, v's lora_B inputs fall between a LoRA layer's calls


@needs_fusion
@pytest.mark.parametrize("adapters_fp32", [False, True], ids=["bf16-adapters", "fp32-adapters"])
def test_a_lora_layers_lora_a_joins_its_base_layers_group(adapters_fp32):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    model = peft.get_peft_model(bf16_model("tiny-qwen2"), config, autocast_adapter_dtype=adapters_fp32).eval()
    fused, unfused = PackedLinears(fuse=True), PackedLinears()
    assert torch.equal(logits_on(model, fused), logits_on(model, unfused))
    attention = model.base_model.model.model.layers[0].self_attn
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    up = model.base_model.model.model.layers[0].mlp.up_proj
    groups = grouped_weights(fused)  # q, k, v have biases and lora_A none: one GEMM each
    assert tuple(id(linear.weight) for linear in (q.base_layer, k, v.base_layer)) in groups
    gate_up = [model.base_model.model.model.layers[0].mlp.gate_proj, up.base_layer]
    if not adapters_fp32:
        assert (id(q.lora_A["default"].weight), id(v.lora_A["default"].weight)) in groups
        gate_up.append(up.lora_A["default"])
    else:  # peft's default: adapters in fp32, each one's input cast for it, so no input is shared
        assert q.lora_A["default"].weight.dtype == torch.float32
    assert tuple(id(linear.weight) for linear in gate_up) in groups
