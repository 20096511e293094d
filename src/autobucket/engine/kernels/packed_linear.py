"""Linear layers on prepacked weights that follow the live weights.

`F.linear` on an unpacked weight lets MKL reorder the weight on every call and pick its blocking by the
batch size, so a row's output can depend on how many other rows ride along (measured: 4.8e-7 between
M = 1 and M = 2 on a 256 -> 1,024 linear, AMD EPYC). oneDNN on a weight reordered once
(`mkldnn._reorder_linear_weight`) is faster on the decode shapes that dominate (the 8 x 256 x 32,000 head:
1.44 vs 3.3 ms, Intel Xeon) and gave a row bitwise the same output for M = 2 ... 4,096 on every shape
probed; M = 1 took another path on one shape (1,536 -> 576), so a single row runs as a batch of two.

Every linear the engine's forwards run is routed here by `packed_linears` (`function_routes.py`: the
`F.linear` and `Conv1D` addmm calls of this thread's forwards inside the block, the model's modules never
touched; LoRA layers' base and low-rank linears are ordinary `F.linear` calls and are packed alike;
GPT-2's `Conv1D` is an `addmm` on a transposed parameter and is packed transposed). A packed copy is
keyed on the weight's identity, `data_ptr()`, `_version` and the process's optimizer steps
(`model_access/weight_versions.py`: fused optimizers do not bump `_version`): an `optimizer.step()`, a
`copy_` under `no_grad` or `load_state_dict` between calls and the next forward repacks; a write
through `.data` (`param.data.copy_(...)`) bypasses the version counter and needs `refresh()`
(`Rollout.refresh_weights()`).

bf16 weights run oneDNN's bf16 GEMM (AMX / AVX512-BF16) in fixed blocks of `ROW_BLOCK` rows. That GEMM
picks its kernel by the number of rows, so a row's output depends on M (measured on `[M, 1024] x
[1024, 256]` and five other shapes); inside one fixed block shape a row's output was bitwise the same
wherever it sat and whatever the other rows were, on every shape probed. So every call is cut into
32-row blocks (the last zero-padded), and each weight shape is probed once per process
(`bf16_blocks_invariant`) before its bf16 pack is trusted; a call of at most 16 rows runs as one 16-row
block where a second probe finds 16-row calls bitwise the 32-row block's (`bf16_small_blocks_agree`),
and a prefill-sized call runs its leading rows as single calls of 128 to 2,048 rows where a probe
per shape and size finds them bitwise the 32-row blocks' (`bf16_large_block_agrees`: 2-8x faster).
A shape that fails, or a CPU without a native bf16 GEMM, gets its weight packed as fp32 (exact) and the
fp32 GEMM's output rounded to bf16: invariant on every shape probed, 2-4x slower.

fp32 GEMMs (fp32 weights, and those bf16-as-fp32 packs) run the engine's own fixed-order kernel where
its library builds with AVX-512 or AVX2 (`csrc/fixed_order_linear.cpp`: each output one FMA chain over k in
order, so invariant by construction, no probe and no M = 1 workaround), else oneDNN's fp32 GEMM. On an
AMD EPYC (Zen 5) it took 0.35-0.84x oneDNN's time at a decode step's 8-32 rows and 1.00-1.11x at
1,024-2,048 rows; MKL (`F.linear`) ran its AVX2 code there, 2-3x slower than both
(`benchmarks/fp32_linears.py`). A weight past the packed-weight budget is read where it is by the
kernel's unpacked form (`fixed_order_linear_unpacked`: the same chains, bitwise), and a weight updated in
place gets its panels rewritten in the storage they had. Why 32 rows: a decode step's batch; a 16-row step padded to 32 took
1.4 ms on the 256 -> 32,000 head, padded to 128 it took 4.0 ms (Intel Xeon, AMX)."""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from autobucket.checks import warn_once
from autobucket.engine.kernels.fused_linear import FusedGroup, LinearFusion
from autobucket.engine.model_access.function_routes import (
    linear_route,
    linears_routed_to,
    original_addmm,
    original_linear,
)
from autobucket.engine.model_access.weight_versions import tensor_version

ROW_BLOCK = 32  # rows per bf16 GEMM call: one fixed shape, so a row's result never depends on M
SMALL_BLOCK = 16  # rows of a call of at most 16 rows, where the shape's probe found them equal to 32's
FIXED_ORDER_PANEL = 32  # output columns per panel of `fixed_order_linear` (csrc/fixed_order_linear.cpp)


@functools.cache  # read on every linear call of a forward: the answer is fixed for the process
def onednn_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN packed linears run for `dtype` on this CPU: fp32, and bf16 (natively in fixed row
    blocks where the CPU has a bf16 GEMM and the shape passes its probe, else computed in fp32)."""
    return torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16)


class SlowBf16GemmWarning(RuntimeWarning):
    """A bf16 model on the default kernels, on a CPU where torch's bf16 GEMMs are far slower than fp32's."""


@functools.cache  # a property of the CPU and the torch build
def native_bf16_gemm() -> bool:
    """Whether oneDNN runs bf16 GEMMs on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; AMX and
    AVX512-BF16 where present). Without them, torch's bf16 `F.linear` took 5-10x the fp32 time (AMD
    EPYC Zen 3, AVX2: 64 x 256 x 32,000 127 against 26 ms, 1,884 x 256 x 1,024 120 against 12 ms), and
    the invariant kernels pack bf16 weights as fp32."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def slow_bf16_gemm_message(dtype: torch.dtype, kernels: str, device_type: str, native: bool) -> str | None:
    """One line with the fix, or None: a bf16 CPU model on `kernels="hf"` where the CPU lacks a native bf16
    GEMM (`native`) runs every linear on torch's slow bf16 path."""
    if dtype != torch.bfloat16 or kernels != "hf" or device_type != "cpu" or native:
        return None
    return (
        "this bf16 model runs kernels='hf' on a CPU where oneDNN has no bf16 GEMM (AVX2 only), where "
        "torch's bf16 linears take 5-10x the time of fp32 ones; RolloutConfig(kernels=\"invariant\") runs them "
        "as fp32 GEMMs rounded to bf16 (a GRPO-like bf16 call in 0.17x the time on an AMD EPYC Zen 3)"
    )


def warn_if_slow_bf16_gemm(dtype: torch.dtype, kernels: str, device_type: str) -> None:
    """Warn, once per process, where `slow_bf16_gemm_message` has something to say."""
    message = slow_bf16_gemm_message(dtype, kernels, device_type, native_bf16_gemm())
    if message is not None:
        warn_once(message, SlowBf16GemmWarning, stacklevel=4)  # at the line that built the Rollout


@functools.cache  # once per weight shape and process: six 32-row GEMMs
def bf16_blocks_invariant(in_features: int, out_features: int) -> bool:
    """Whether oneDNN's bf16 GEMM on a packed [out, in] weight gives each row of a `ROW_BLOCK`-row block
    bitwise the same output wherever it sits and whatever the other rows are. Probed with random data
    from a private generator (the caller's RNG is untouched): three blocks of rows of mixed scales, each
    against the same rows scattered among fresh ones."""
    if not native_bf16_gemm():
        return False
    generator, packed = _probe_weight(in_features, out_features, in_features * 100_003 + out_features)
    for kept in (1, ROW_BLOCK // 2, ROW_BLOCK - 1):
        rows = _probe_rows(generator, in_features)
        reference = _onednn_linear(rows, packed, None)
        places = torch.randperm(ROW_BLOCK, generator=generator)[:kept]
        mixed = torch.randn(ROW_BLOCK, in_features, generator=generator).bfloat16()
        mixed[places] = rows[:kept]
        if not torch.equal(_onednn_linear(mixed, packed, None)[places], reference[:kept]):
            return False
    return True


@functools.cache  # once per weight shape and process
def bf16_small_blocks_agree(in_features: int, out_features: int) -> bool:
    """Whether 16-row calls of oneDNN's bf16 GEMM give bitwise the rows' outputs inside a 32-row call on
    a packed [out, in] weight (so a decode step of <= 16 rows need not pad to 32: 0.055 vs 0.094 ms on
    576 -> 576, Intel Xeon); probed like `bf16_blocks_invariant`, which must hold first."""
    if not bf16_blocks_invariant(in_features, out_features):
        return False
    generator, packed = _probe_weight(in_features, out_features, in_features * 7 + out_features * 3)
    for _ in range(3):
        rows = _probe_rows(generator, in_features)
        halves = [_onednn_linear(rows[first : first + SMALL_BLOCK], packed, None) for first in (0, SMALL_BLOCK)]
        if not torch.equal(torch.cat(halves), _onednn_linear(rows, packed, None)):
            return False
    return True


@functools.cache  # once per group shape and process: 24 ms for SmolLM2's gate/up
def fused_columns_agree(in_features: int, out_features: tuple[int, ...], has_bias: bool) -> bool:
    """Whether one oneDNN bf16 GEMM block on the concatenated [sum N_i, K] weight gives each member's
    columns bitwise its own GEMM's output in the same `ROW_BLOCK` rows (every bf16 call is made of such
    blocks, so one block shape decides it). Random data, a private generator."""
    generator = torch.Generator().manual_seed(in_features * 31 + sum(out_features))
    weights = [(torch.randn(n, in_features, generator=generator) * in_features**-0.5).bfloat16() for n in out_features]
    biases = [torch.randn(n, generator=generator).bfloat16() if has_bias else None for n in out_features]
    packs = [torch.ops.mkldnn._reorder_linear_weight(weight, ROW_BLOCK) for weight in weights]
    fused_pack = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights), ROW_BLOCK)
    fused_bias = torch.cat(biases) if has_bias else None  # type: ignore[arg-type]
    for _ in range(2):
        rows = _probe_rows(generator, in_features)
        alone = [_onednn_linear(rows, pack, bias) for pack, bias in zip(packs, biases, strict=True)]
        if not torch.equal(_onednn_linear(rows, fused_pack, fused_bias), torch.cat(alone, dim=-1)):
            return False
    return True


# Row counts of one bf16 call for prefill-sized inputs, largest first. On bench-qwen2's and SmolLM2's
# projections one 2,048-row call took 2-8x less than 64 calls of 32 rows (Intel Xeon, AMX). Whether it
# gives the rows bitwise their 32-row results depends on the shape and size: on SmolLM2's, every
# multiple of 64 from about the weight's width up did (576 -> 960: from 960 rows), none below; on
# bench-qwen2's, nearly all. Hence a ladder of sizes, each probed per shape.
LARGE_BLOCKS = (2048, 1536, 1024, 768, 512, 384, 256, 128)
LARGE_BLOCK_MAX_OUT = 16384  # widest weight given LARGE_BLOCKS (a fused gate/up of 2 x 8,192 included)
# Wider weights (output heads) get a shorter ladder: on 256 -> 32,000 one 2,048-row call was 1.7x slower
# than 32-row calls, while on SmolLM2's 576 -> 49,152 1,024 rows took 405 ms in 32-row calls, 203 ms in
# 512-row calls, 149 ms in 256- or 128-row calls and 232 ms in one (MKL's F.linear: 233 ms); the probe
# allows 512 there, not 256 or 128, and no size on Qwen2.5-0.5B's 896 -> 151,936 (Intel Xeon, AMX). Two
# sizes only: each probe builds a random weight of the head's shape, once per process (Qwen2.5-0.5B's:
# 4.7 s at 512 rows, 2.1 s at 256), paid by the first call of at least that many rows.
HEAD_BLOCKS = (512, 256)


@functools.cache  # once per weight shape, block size and process
def bf16_large_block_agrees(in_features: int, out_features: int, rows_count: int, has_bias: bool) -> bool:
    """Whether one oneDNN bf16 call over `rows_count` rows on a packed [out, in] weight gives every row
    bitwise its output in `ROW_BLOCK`-row calls (random rows of mixed scales, a private generator)."""
    if not bf16_blocks_invariant(in_features, out_features):
        return False
    generator, packed = _probe_weight(in_features, out_features, in_features * 13 + out_features + rows_count)
    bias = torch.randn(out_features, generator=generator).bfloat16() if has_bias else None
    rows = torch.cat([_probe_rows(generator, in_features) for _ in range(rows_count // ROW_BLOCK)])
    blocks = [_onednn_linear(rows[first : first + ROW_BLOCK], packed, bias) for first in range(0, rows_count, ROW_BLOCK)]
    return torch.equal(_onednn_linear(rows, packed, bias), torch.cat(blocks))


def _probe_weight(in_features: int, out_features: int, seed: int) -> tuple[torch.Generator, torch.Tensor]:
    """A private generator and a random bf16 [out, in] weight packed for ROW_BLOCK rows."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) * in_features**-0.5).bfloat16()
    return generator, torch.ops.mkldnn._reorder_linear_weight(weight, ROW_BLOCK)


def _probe_rows(generator: torch.Generator, in_features: int) -> torch.Tensor:
    """ROW_BLOCK random bf16 rows of scales 1e-2 .. 1e2."""
    scales = 10.0 ** torch.randint(-2, 3, (ROW_BLOCK, 1), generator=generator)
    return (torch.randn(ROW_BLOCK, in_features, generator=generator) * scales).bfloat16()


def _onednn_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


@dataclass
class _Pack:
    owner: weakref.ref  # the weight this copy was made from
    version: tuple[int, int | None, int] | None  # (data_ptr, _version, optimizer steps) when packed; None: stale
    packed: torch.Tensor  # oneDNN-blocked copy of the weight (bf16 when `row_blocks`), or fixed-order panels
    row_blocks: bool  # a bf16 GEMM run in ROW_BLOCK-row blocks (else one fp32 GEMM over all rows)
    small_block: bool = False  # calls of <= SMALL_BLOCK rows run as one SMALL_BLOCK-row block
    fixed_order: bool = False  # fp32 panels [ceil(N / 32), K, 32] for `fixed_order_linear` (else oneDNN)
    out_features: int = 0
    unpacked: bool = False  # fixed order on the weight itself, fp32 [N, K] (a call past the budget)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class PackedLinears:
    """The packed copies of one model's weights (kept across calls) and what packing cost.

    `budget_bytes` bounds the copies (None: every linear packed). Past it, a weight is not kept: its
    GEMM reads the live weight in oneDNN's plain layout, which oneDNN reorders per call into the same
    blocked layout and runs on the same kernel, so the values are bitwise the packed ones (probed on
    every shape of `tests/test_packed_linear.py`, fp32 and bf16) at 15-25% more time per GEMM; a
    fixed-order weight gets its panels made for the call (the same values by construction). Weights
    are packed in the order the forward first meets them (the layers, then the output head)."""

    def __init__(self, budget_bytes: int | None = None, fuse: bool = False, fixed_order: bool | None = None) -> None:
        self._packs: dict[int, _Pack] = {}
        self._fused: dict[int, _FusedPack] = {}  # id(group) -> its concatenated weight's pack
        self._held_bytes = 0
        self.budget_bytes = budget_bytes
        self.packs_made = 0  # packs made, first ones and repacks after weight updates
        self.pack_ms = 0.0
        self.unpacked_calls = 0  # GEMMs run on a live weight because the budget was full
        # `fuse`: bf16 linears that read one input run as one GEMM where the values stay bitwise the same
        # (`fused_linear.py`); the rollout's forwards fuse, the trainer's scope does not (its forwards
        # need gradients, and alternating both would repack)
        self.fusion = LinearFusion() if fuse else None
        # fp32 GEMMs on `fixed_order_linear` (None: wherever it is vectorized) or on oneDNN (False: the
        # benchmarks' comparison)
        self.fixed_order = fixed_order_op() is not None if fixed_order is None else fixed_order

    @property
    def nbytes(self) -> int:
        return self._held_bytes

    def refresh(self) -> None:
        """Mark every packed copy stale: the next forward repacks (after writes that bypass version
        counters), fixed-order panels in place where the weight's shape is unchanged."""
        for pack in self._packs.values():
            pack.version = None
        self._held_bytes -= sum(fused.pack.nbytes for fused in self._fused.values())
        self._fused.clear()

    def forwards_done(self) -> None:
        """The forwards of one scope are over: finish learning which linears share an input, and drop
        the activations held for it."""
        if self.fusion is not None:
            self.fusion.forwards_done()

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recompute_safe: bool = False
    ) -> torch.Tensor:
        """x [..., K], weight [N, K], bias [N] | None -> [..., N], like `F.linear`. Under autograd the
        gradients are ordinary GEMMs'; `recompute_safe` (gradient checkpointing on): see `_with_values`."""
        needs_grad = _needs_grad(x, weight, bias)
        # fusion is for bf16 row blocks only (see `_fused_pack_for`): fp32 calls skip its bookkeeping
        if self.fusion is not None and weight.dtype == torch.bfloat16 and not needs_grad and _eligible(weight, x):
            fused = self._fused_linear(x, weight, bias, self.fusion)
            if fused is not None:
                return fused
        pack = self._pack_for(weight, x, transposed=False)
        if pack is None:
            return original_linear(x, weight, bias)
        if needs_grad:
            if recompute_safe:
                return _with_values(original_linear(x, weight, bias), _packed_matmul(x.detach(), pack, _detached(bias)))
            return _PackedLinearFunction.apply(x, weight, bias, pack, False)
        if self.fusion is not None and pack.row_blocks:
            self.fusion.observe(x, weight, bias)
        return _packed_matmul(x, pack, bias)

    def ready_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`linear(x, weight, bias)` without its general checks, for the call a decode step makes most: an
        fp32 weight whose fixed-order panels are current, contiguous fp32 rows, no autograd. The same op
        on the same panels, so the same values. None for any other call (the caller runs `linear`, which
        packs or repacks first)."""
        if x.dtype != torch.float32 or not x.is_contiguous() or (bias is not None and bias.dtype != torch.float32):
            return None
        if _needs_grad(x, weight, bias):
            return None
        panels = self.ready_panels(weight)
        if panels is None:
            return None
        out = fixed_order_op()(x.view(-1, x.shape[-1]), panels, bias, weight.shape[0])
        return out.view(*x.shape[:-1], weight.shape[0])

    def ready_panels(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The fixed-order panels `[ceil(N / 32), K, 32]` of an fp32 `weight`, where they are current
        (made from this weight at its present version); else None."""
        pack = self._packs.get(id(weight))
        if pack is None or not pack.fixed_order or pack.unpacked or weight.dtype != torch.float32:
            return None
        if pack.owner() is not weight or pack.version != tensor_version(weight):
            return None
        return pack.packed

    def _fused_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fusion: LinearFusion
    ) -> torch.Tensor | None:
        """This call's columns of a fused GEMM: handed over (a group's member), or computed with the
        whole group's (its first weight); None for a call that runs its own GEMM."""
        columns = fusion.take(x, weight, bias)
        if columns is not None:
            return columns
        group = fusion.group_led_by(weight, bias)
        if group is None:
            return None
        fused = self._fused_pack_for(group)
        if fused is None:
            return None
        return fusion.hand_out(group, x, _packed_matmul(x, fused.pack, fused.bias))

    def _fused_pack_for(self, group: FusedGroup) -> _FusedPack | None:
        """The group's concatenated weight packed (repacked after any member's update), or None, and
        the group given up, where fusing could change a value or the budget has no room."""
        pairs = group.live()
        if pairs is None:
            group.broken = True
            return None
        versions = tuple(tensor_version(t) for pair in pairs for t in pair if t is not None)
        fused = self._fused.get(id(group))
        if fused is not None and fused.versions == versions:
            return fused
        started = time.perf_counter()
        weights = [weight.detach() for weight, _ in pairs]
        dense, in_features = torch.cat(weights), weights[0].shape[1]  # [sum N_i, K]
        has_bias = pairs[0][1] is not None
        # bf16 row blocks only: there one block shape decides the probe. fp32 GEMMs are not fused: on
        # oneDNN a probe would need every row count (0.4-1.3 s a shape) and the decode step gained nothing
        # measurable (fused / unfused 0.99-1.01, Intel Xeon); on the fixed-order kernel fusing is exact by
        # construction (each column its own chain) but made the bench-qwen2 step 3.5% slower (9.58 vs
        # 9.24 ms, AMD EPYC: its per-call cost is small, and the members' column views cost downstream)
        agree = all(_bf16_blocks(weight) for weight in [dense, *weights]) and fused_columns_agree(
            in_features, tuple(group.out_features), has_bias
        )
        own = [self._packs[id(weight)] for weight, _ in pairs if id(weight) in self._packs]
        freed = own + ([fused.pack] if fused else [])
        held_after = self._held_bytes - sum(pack.nbytes for pack in freed) + dense.numel() * dense.element_size()
        if not agree or (self.budget_bytes is not None and held_after > self.budget_bytes):
            group.broken = True
            self._drop_fused(group)
            return None
        for weight, _ in pairs:
            self._packs.pop(id(weight), None)  # the members' own copies: the fused one serves them
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, ROW_BLOCK)
        small = bf16_small_blocks_agree(in_features, dense.shape[0])
        pack = _Pack(weakref.ref(pairs[0][0]), versions[0], packed, True, small)
        bias = torch.cat([bias.detach() for _, bias in pairs if bias is not None]) if has_bias else None
        self._fused[id(group)] = fused = _FusedPack(pack, bias, versions)
        self._held_bytes = held_after
        self.packs_made += 1
        self.pack_ms += (time.perf_counter() - started) * 1e3
        return fused

    def _drop_fused(self, group: FusedGroup) -> None:
        fused = self._fused.pop(id(group), None)
        if fused is not None:
            self._held_bytes -= fused.pack.nbytes

    def addmm(
        self, bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recompute_safe: bool = False
    ) -> torch.Tensor:
        """bias [N] + x [M, K] @ weight [K, N]: GPT-2's `Conv1D` layers (weights stored transposed)."""
        pack = self._pack_for(weight, x, transposed=True)
        if pack is None:
            return original_addmm(bias, x, weight)
        if _needs_grad(x, weight, bias):
            if recompute_safe:
                return _with_values(original_addmm(bias, x, weight), _packed_matmul(x.detach(), pack, bias.detach()))
            return _PackedLinearFunction.apply(x, weight, bias, pack, True)
        return _packed_matmul(x, pack, bias)

    def _pack_for(self, weight: torch.Tensor, x: torch.Tensor, transposed: bool) -> _Pack | None:
        if not _eligible(weight, x):
            return None
        pack, version = self._packs.get(id(weight)), tensor_version(weight)
        if pack is not None and pack.owner() is weight and pack.version == version:
            return pack
        started = time.perf_counter()
        dense = weight.detach().t().contiguous() if transposed else weight.detach()  # [N, K]
        row_blocks = _bf16_blocks(dense)
        fixed_order = not row_blocks and self.fixed_order
        if fixed_order and pack is not None and pack.fixed_order and pack.owner() is weight and (
            pack.packed.shape == (-(-dense.shape[0] // FIXED_ORDER_PANEL), dense.shape[1], FIXED_ORDER_PANEL)
        ):  # a weight updated in place (an optimizer step): its panels rewritten where they are
            fixed_order_panels(dense, out=pack.packed)
            pack.version = version
            self.packs_made += 1
            self.pack_ms += (time.perf_counter() - started) * 1e3
            return pack
        # the GEMM's weight: bf16 for the row blocks; fp32, or bf16 as fp32 (exact): see the module docstring
        source = dense if row_blocks or fixed_order else dense.float()  # (the panels widen as they copy)
        if pack is not None:
            del self._packs[id(weight)]
            self._held_bytes -= pack.nbytes
        size = _panel_bytes(*source.shape) if fixed_order else source.numel() * source.element_size()
        small = row_blocks and bf16_small_blocks_agree(dense.shape[1], dense.shape[0])
        fp32_kernel = {"fixed_order": fixed_order, "out_features": dense.shape[0]}  # the _Pack fields of the fp32 GEMM
        if self.budget_bytes is not None and self._held_bytes + size > self.budget_bytes:
            self.unpacked_calls += 1
            if fixed_order:  # no copy: the unpacked kernel reads the weight as it is, the same chains
                source, fp32_kernel["unpacked"] = source.float(), True
            elif row_blocks and x.numel() > ROW_BLOCK * x.shape[-1]:  # several blocks: reorder once, not per block
                source = torch.ops.mkldnn._reorder_linear_weight(source, ROW_BLOCK)
            return _Pack(weakref.ref(weight), version, source, row_blocks, small, **fp32_kernel)  # this call only
        if fixed_order:
            packed = fixed_order_panels(source)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(source, ROW_BLOCK if row_blocks else 64)
        pack = _Pack(weakref.ref(weight), version, packed, row_blocks, small, **fp32_kernel)
        self._packs[id(weight)] = pack
        self._held_bytes += pack.nbytes
        self.packs_made += 1
        self.pack_ms += (time.perf_counter() - started) * 1e3
        return pack


@dataclass
class _FusedPack:
    pack: _Pack  # the concatenated [sum N_i, K] weight
    bias: torch.Tensor | None  # the concatenated biases
    versions: tuple  # every member weight's and bias's version when packed


def _bf16_blocks(dense: torch.Tensor) -> bool:
    """Whether a [N, K] weight runs oneDNN's bf16 GEMM in row blocks (else an fp32 GEMM)."""
    return dense.dtype == torch.bfloat16 and bf16_blocks_invariant(dense.shape[1], dense.shape[0])


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


class _WithValues(torch.autograd.Function):
    """`native`'s autograd graph carrying `values` (same shape) as its forward result."""

    @staticmethod
    def forward(ctx, native, values):  # type: ignore[override]
        return values

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        return grad_output, None


def _with_values(native: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The packed kernel's values on the ordinary linear's graph. Gradient checkpointing recomputes a
    layer's forward during backward, where no linear is routed any more, and requires the same saved
    tensors as the first forward: so the first forward saves what the ordinary linear saves (it runs,
    once more than otherwise) and only the values it passes on are the invariant ones."""
    return _WithValues.apply(native, values)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _PackedLinearFunction(torch.autograd.Function):
    """A trainer's forward under `autobucket.invariant`: values from the packed kernel, gradients from
    ordinary GEMMs on the live weight (`weight` [N, K], or [K, N] for `Conv1D` when `transposed`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, pack, transposed):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.transposed, ctx.has_bias = transposed, bias is not None
        return _packed_matmul(x, pack, bias)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dense = weight.t() if ctx.transposed else weight  # [N, K]
        grad_rows = grad_output.reshape(-1, grad_output.shape[-1])  # [M, N]
        grad_x = (grad_rows @ dense).reshape(x.shape) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_rows.t() @ x.reshape(-1, x.shape[-1])  # [N, K]
            grad_weight = grad_weight.t() if ctx.transposed else grad_weight
        grad_bias = grad_rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None


def _packed_matmul(x: torch.Tensor, pack: _Pack, bias: torch.Tensor | None) -> torch.Tensor:
    # [M, K]: 2-D was 10-15% faster than [M, 1, K]; contiguous, so a fused GEMM's column view as input
    # (a LoRA layer's lora_B reads lora_A's columns) gives the GEMM the layout the trainer's call has
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = _in_row_blocks(rows, pack, bias) if pack.row_blocks else _in_fp32(rows, pack, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _in_fp32(rows: torch.Tensor, pack: _Pack, bias: torch.Tensor | None) -> torch.Tensor:
    """One fp32 GEMM over all rows, rounded to the input's dtype: [M, K] -> [M, N]."""
    widened = rows.dtype != torch.float32  # fp32 inputs skip the conversions: ~6 us a call of ~45
    rows_fp32 = rows.float() if widened else rows
    bias_fp32 = None if bias is None else (bias.float() if bias.dtype != torch.float32 else bias)
    if pack.unpacked:
        out = torch.ops.autobucket.fixed_order_linear_unpacked(rows_fp32, pack.packed, bias_fp32)
    elif pack.fixed_order:
        out = torch.ops.autobucket.fixed_order_linear(rows_fp32, pack.packed, bias_fp32, pack.out_features)
    elif rows.shape[0] == 1:  # one row: oneDNN's M = 1 path can differ, run it as two
        out = _onednn_linear(rows_fp32.expand(2, -1), pack.packed, bias_fp32)[:1]
    else:
        out = _onednn_linear(rows_fp32, pack.packed, bias_fp32)
    return out.to(rows.dtype) if widened else out


def _in_row_blocks(rows: torch.Tensor, pack: _Pack, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16 GEMMs of exactly one block's rows each, the last block zero-padded: [M, K] -> [M, N]. The
    block is ROW_BLOCK rows, or SMALL_BLOCK for a call that fits one where the shape allows it; a
    prefill-sized call runs its leading rows in `LARGE_BLOCKS` where the shape's probe allows them."""
    count = rows.shape[0]
    large = _large_blocks_for(count, rows.shape[1], pack.packed.shape[0], bias is not None)
    if large:
        return _in_large_blocks(rows, pack, bias, large)
    return _in_fixed_blocks(rows, pack, bias)


def _large_blocks_for(count: int, in_features: int, out_features: int, has_bias: bool) -> list[int]:
    """The large blocks a call of `count` rows starts with, largest first, each bitwise the rows'
    ROW_BLOCK-row results (probed per shape and size at the first call that could use it)."""
    ladder = LARGE_BLOCKS if out_features <= LARGE_BLOCK_MAX_OUT else HEAD_BLOCKS
    if count < ladder[-1]:
        return []
    sizes, left = [], count
    for size in ladder:
        while left >= size and bf16_large_block_agrees(in_features, out_features, size, has_bias):
            sizes.append(size)
            left -= size
    return sizes


def _in_large_blocks(rows: torch.Tensor, pack: _Pack, bias: torch.Tensor | None, sizes: list[int]) -> torch.Tensor:
    pieces, first = [], 0
    for size in sizes:  # one oneDNN call each: a large block is one fixed shape too
        pieces.append(_onednn_linear(rows[first : first + size], pack.packed, bias))
        first += size
    if first < rows.shape[0]:
        pieces.append(_in_fixed_blocks(rows[first:], pack, bias))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _in_fixed_blocks(rows: torch.Tensor, pack: _Pack, bias: torch.Tensor | None) -> torch.Tensor:
    """The loop of one-block calls: in the engine's C++ library (`blocked_linear`) once it is built,
    else here (the same calls)."""
    count = rows.shape[0]
    block = SMALL_BLOCK if pack.small_block and count <= SMALL_BLOCK else ROW_BLOCK
    blocked_linear = _blocked_linear_op()
    if blocked_linear is not None:
        return blocked_linear(rows, pack.packed, bias, block)
    padding = -count % block
    if padding:
        rows = torch.cat([rows, rows.new_zeros(padding, rows.shape[1])])
    starts = range(0, len(rows), block)
    blocks = [_onednn_linear(rows[first : first + block], pack.packed, bias) for first in starts]
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return out[:count] if padding else out


def _eligible(weight: torch.Tensor, x: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu" and weight.dim() == 2 and x.dtype == weight.dtype and x.shape[-1] > 0
        and x.numel() > 0 and onednn_available(weight.dtype)
    )  # fmt: skip


def current_packs() -> PackedLinears | None:
    """The packs this thread's linears run on now (`packed_linears`), where the scope computes values only
    (no gradient checkpointing); else None."""
    route = linear_route()
    if isinstance(route, _Route) and not route.recompute_safe:
        return route.packs
    return None


class _Route:
    """What this thread's routed linear calls run on: `packs`, with the scope's `recompute_safe`."""

    def __init__(self, packs: PackedLinears, recompute_safe: bool) -> None:
        self.packs, self.recompute_safe = packs, recompute_safe

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.packs.linear(x, weight, bias, self.recompute_safe)

    def addmm(self, bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.packs.addmm(bias, x, weight, self.recompute_safe)

    def ready_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return self.packs.ready_linear(x, weight, bias)


@contextmanager
def packed_linears(packs: PackedLinears, recompute_safe: bool = False, conv1d: bool = False) -> Iterator[None]:
    """This thread's `F.linear` calls inside the block run on `packs` (and `Conv1D` addmm calls where
    `conv1d`: the model has such layers); `recompute_safe`: the model recomputes forwards in backward
    (gradient checkpointing), see `_with_values`."""
    try:
        with linears_routed_to(_Route(packs, recompute_safe), conv1d):
            yield
    finally:
        packs.forwards_done()


def check_fp32_precision() -> None:
    """Refuse to run fp32 models where oneDNN was told to compute fp32 matmuls in a lower precision."""
    setting = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", "none")
    fpmath = os.environ.get("ONEDNN_DEFAULT_FPMATH_MODE", "").strip().upper()
    if setting not in ("none", "ieee") or fpmath not in ("", "STRICT"):
        raise ValueError(
            f"kernels='invariant' computes fp32 models in strict fp32, but torch.backends.mkldnn.matmul."
            f"fp32_precision={setting!r} and ONEDNN_DEFAULT_FPMATH_MODE={fpmath!r} ask oneDNN for a lower "
            "precision: reset them (fp32_precision='ieee', unset the variable) or use kernels='hf'"
        )


def _panel_bytes(out_features: int, in_features: int) -> int:
    return -(-out_features // FIXED_ORDER_PANEL) * FIXED_ORDER_PANEL * in_features * 4


def fixed_order_panels(dense: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A [N, K] weight (fp32, or bf16 widened exactly) as `fixed_order_linear`'s fp32 panels
    [ceil(N / 32), K, 32], columns past N zero; written into `out` (an earlier pack of the same shape)
    where given. One strided copy: no padded or widened temporary, and into `out` no new pages (a repack
    of bench-qwen2's 33 MB head took 26 ms through a padded copy and a new tensor, Intel Xeon)."""
    out_features, in_features = dense.shape
    panels, full = -(-out_features // FIXED_ORDER_PANEL), out_features // FIXED_ORDER_PANEL
    if out is None:
        out = torch.empty(panels, in_features, FIXED_ORDER_PANEL, dtype=torch.float32)
    if full:  # [full * 32, K] -> [full, K, 32]
        out[:full].copy_(dense[: full * FIXED_ORDER_PANEL].view(full, FIXED_ORDER_PANEL, in_features).transpose(1, 2))
    if full < panels:  # the last panel's columns past N are zero
        tail = out[full]
        tail.zero_()
        tail[:, : out_features - full * FIXED_ORDER_PANEL].copy_(dense[full * FIXED_ORDER_PANEL :].t())
    return out


@functools.cache
def fixed_order_op():
    """The fixed-order fp32 linear where the kernel library builds with AVX-512 or AVX2, else None (oneDNN's fp32
    GEMM instead: see the module docstring)."""
    from autobucket.engine.kernels.invariant_attention import kernel_library_builds

    if not kernel_library_builds():  # oneDNN serves
        return None
    return torch.ops.autobucket.fixed_order_linear if torch.ops.autobucket.fixed_order_linear_vectorized() else None


@functools.cache
def _blocked_linear_op():
    """The C++ block loop, or None where the engine's kernel library does not build (no compiler)."""
    from autobucket.engine.kernels.invariant_attention import kernel_library_builds

    if not kernel_library_builds():  # the Python loop gives the same calls
        return None
    return torch.ops.autobucket.blocked_linear
