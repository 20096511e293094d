"""A call's floor on this core: the least time any engine could take for it, from this run's own peak
GEMM rate and memory read rate, printed beside each workload.

Prefill is compute-bound: its floor is its FLOPs over the peak fp32 GEMM rate. A decode step is bound
by whichever is longer, its FLOPs at that rate or its bytes (every weight and every row's K/V read once)
at the read rate: a step of 32 rows of a 20M-parameter model reads 80 MB for 1.3 GFLOP, so the FLOP floor
alone would put decode-heavy calls at a fifth of what any engine can reach. Both rates are measured in
the process that runs the comparison:
- peak GEMM: the fastest of MKL (`F.linear`), oneDNN's packed linear and the engine's fixed-order
  linear on one 2,048 x 1,024 x 1,024 fp32 GEMM (MKL runs its AVX2 code on AMD EPYCs: the engine's own
  kernels are the peak there);
- read rate: the best of several sums over a 256 MB tensor (no cache holds it).

Counted: every linear of every layer and the output head (the last token of each prompt in prefill,
every row in decode), attention's QK^T and PV (causal in prefill); not counted: norms, RoPE, softmax and
the other elementwise work (a few percent of the FLOPs), which makes the floor a little low, never high."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from autobucket.engine.intercept.kernel_sets import invariant_kernels
from autobucket.engine.kernels.library import load_invariant_kernels
from autobucket.engine.kernels.packed_linear import PackedLinears

FP32_BYTES = 4


@dataclass(frozen=True)
class CoreRates:
    gemm_gflops: float  # the fastest fp32 GEMM kernel's rate on a large GEMM
    gemm_kernel: str  # which kernel that was
    read_gb_s: float  # memory read rate (GB/s)


@dataclass(frozen=True)
class Geometry:
    """What the floor needs of a Llama-family config (Qwen2 here)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> Geometry:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, config.vocab_size)  # fmt: skip

    @property
    def layer_weights(self) -> int:
        """Weights of one layer's linears: q, k, v, o and the gated MLP."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate

    @property
    def head_weights(self) -> int:
        return self.hidden * self.vocab


def _best_ms(function: Callable[[], object], repeats: int = 7) -> float:
    function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append((time.perf_counter() - started) * 1e3)
    return min(times)


@torch.inference_mode()
def measure_core_rates(rows: int = 2048, features: int = 1024) -> CoreRates:
    """This core's peak fp32 GEMM rate (fastest of three kernels) and memory read rate."""
    load_invariant_kernels()
    x = torch.randn(rows, features)
    weight = torch.randn(features, features)
    flops = 2 * rows * features * features
    kernels: dict[str, Callable[[], object]] = {"mkl": lambda: F.linear(x, weight)}
    for name, fixed_order in (("onednn", False), ("fixed_order", True)):
        packs = PackedLinears(fixed_order=fixed_order)

        def packed(packs: PackedLinears = packs) -> object:
            with invariant_kernels(packs):
                return F.linear(x, weight)

        kernels[name] = packed
    gflops = {name: flops / _best_ms(run) / 1e6 for name, run in kernels.items()}
    best = max(gflops, key=gflops.__getitem__)
    big = torch.ones(64 * 1024 * 1024)  # 256 MB
    read_gb_s = big.numel() * FP32_BYTES / _best_ms(big.sum, repeats=5) / 1e6
    return CoreRates(gflops[best], best, read_gb_s)


def prefill_gflop(geometry: Geometry, lengths: Sequence[int]) -> float:
    """Every prompt prefilled alone (no padding): linears per token, causal attention, the head once."""
    g = geometry
    linears = 2 * g.layers * g.layer_weights * sum(lengths)
    attention = g.layers * 2 * g.heads * g.head_dim * sum(n * (n + 1) for n in lengths)  # QK^T + PV, causal
    head = 2 * g.head_weights * len(lengths)
    return (linears + attention + head) / 1e9


def decode_floor_ms(geometry: Geometry, lengths: Sequence[int], new_tokens: int, rates: CoreRates) -> float:
    """Each of the `new_tokens - 1` steps after prefill (which gives the first token), every prompt's row
    in it: the longer of its FLOP time and its read time (weights once per step, each row's K/V)."""
    g = geometry
    total = 0.0
    for step in range(1, new_tokens):
        contexts = [n + step for n in lengths]  # keys each row attends to, its new token included
        flops = 2 * len(lengths) * (g.layers * g.layer_weights + g.head_weights)
        flops += g.layers * 4 * g.heads * g.head_dim * sum(contexts)
        read = FP32_BYTES * (g.layers * g.layer_weights + g.head_weights)
        read += FP32_BYTES * g.layers * 2 * g.kv_heads * g.head_dim * sum(contexts)
        total += max(flops / rates.gemm_gflops / 1e6, read / rates.read_gb_s / 1e6)
    return total


def call_floor_ms(config, lengths: Sequence[int], new_tokens: int, rates: CoreRates) -> float:
    """The floor of one greedy call of `new_tokens` tokens per prompt, all prompts decoded together."""
    geometry = Geometry.of(config)
    prefill_ms = prefill_gflop(geometry, lengths) / rates.gemm_gflops * 1e3
    return prefill_ms + decode_floor_ms(geometry, lengths, new_tokens, rates)


def best_rates(samples: Sequence[CoreRates]) -> CoreRates:
    """Rates measured at the start and the end of a run (the VM drifts within one): the best of each, so
    the floor stays a floor."""
    fastest = max(samples, key=lambda rates: rates.gemm_gflops)
    return CoreRates(fastest.gemm_gflops, fastest.gemm_kernel, max(r.read_gb_s for r in samples))
