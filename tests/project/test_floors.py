"""bench-peers' floors (`benchmarks/peers/floors.py`) count what the model computes: the weights it reads
equal the model's own linear weights, and a prefill's FLOPs equal torch's FLOP counter over a real
forward (which counts attention as full, not causal: that part is compared on its own)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autobucket.models import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "peers"))
from floors import CoreRates, Geometry, call_floor_ms, decode_floor_ms, prefill_gflop  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("bench-qwen2")


def test_the_geometry_reads_exactly_the_models_linear_weights(model):
    geometry = Geometry.of(model.config)
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert geometry.layers * geometry.layer_weights + geometry.head_weights == linears


@pytest.mark.parametrize("length", [1, 37, 200])
def test_a_prefills_flops_are_torchs_count_of_the_forward(length):
    model = build_tiny_model("bench-qwen2", attn_implementation="eager")  # attention as matmuls torch counts
    geometry = Geometry.of(model.config)
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(3, 1000, (1, length)), logits_to_keep=1)
    full_attention = geometry.layers * 4 * geometry.heads * geometry.head_dim * length * length
    causal_attention = geometry.layers * 2 * geometry.heads * geometry.head_dim * length * (length + 1)
    ours = prefill_gflop(geometry, [length]) * 1e9
    assert ours - causal_attention == pytest.approx(counter.get_total_flops() - full_attention, rel=1e-12)


def test_a_decode_step_is_bound_by_the_slower_of_its_flops_and_its_reads(model):
    geometry = Geometry.of(model.config)
    compute_bound = CoreRates(gemm_gflops=1.0, gemm_kernel="test", read_gb_s=1e9)
    read_bound = CoreRates(gemm_gflops=1e9, gemm_kernel="test", read_gb_s=1.0)
    lengths = [10, 20, 30]
    weights = geometry.layers * geometry.layer_weights + geometry.head_weights
    kv_per_token = geometry.layers * 2 * geometry.kv_heads * geometry.head_dim
    step_read_ms = 4 * (weights + kv_per_token * (11 + 21 + 31)) / 1e6  # one step: contexts 11, 21 and 31
    assert decode_floor_ms(geometry, lengths, 2, read_bound) == pytest.approx(step_read_ms)
    assert decode_floor_ms(geometry, lengths, 2, compute_bound) > decode_floor_ms(geometry, lengths, 2, read_bound)
    assert decode_floor_ms(geometry, lengths, 1, read_bound) == 0.0  # the only token comes from prefill
    floor = call_floor_ms(model.config, lengths, 2, read_bound)
    assert floor == pytest.approx(prefill_gflop(geometry, lengths) / 1e9 * 1e3 + step_read_ms)
