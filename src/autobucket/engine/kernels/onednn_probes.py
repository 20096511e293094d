"""What oneDNN's GEMMs can do on this CPU, probed once per shape and process, and the fp32 precision guard.

bf16 weights run oneDNN's bf16 GEMM (AMX / AVX512-BF16) in fixed blocks of `ROW_BLOCK` rows. That GEMM
picks its kernel by the number of rows, so a row's output depends on M (`[M, 1024] x [1024, 256]` and
other shapes show it); inside one fixed block shape a row's output was bitwise the same
wherever it sat and whatever the other rows were, on every shape probed. So every call is cut into
32-row blocks (the last zero-padded), and each weight shape is probed once per process
(`bf16_blocks_invariant`) before its bf16 pack is trusted; a call of at most 16 rows runs as one 16-row
block where a second probe finds 16-row calls bitwise the 32-row block's (`bf16_small_blocks_agree`),
and a prefill-sized call runs its leading rows as single calls of 128 to 2,048 rows where a probe
per shape and size finds them bitwise the 32-row blocks' (`bf16_large_block_agrees`: one large call
streams the weight once). A shape that fails, or a CPU without a native bf16 GEMM (`native_bf16_gemm`),
gets its weight packed as fp32 (exact) and the fp32 GEMM's output rounded to bf16: invariant on every
shape probed, and slower than the bf16 GEMM where there is one. Why 32 rows: a decode step's batch; a
larger block would make a small step pay for rows it pads and throws away.

Each probe runs random data from a private generator (the caller's RNG is untouched) and is cached for
the process: the answers are properties of the CPU, the torch build and the shape."""

from __future__ import annotations

import functools
import os

import torch

from autobucket.checks import warn_once

ROW_BLOCK = 32  # rows per bf16 GEMM call: one fixed shape, so a row's result never depends on M
SMALL_BLOCK = 16  # rows of a call of at most 16 rows, where the shape's probe found them equal to 32's

# Outputs a probe compares before it trusts a call size. Where a size runs another kernel whose fp32 sums
# differ in their last bits, few bf16 outputs show it: on [1,024 -> 256] at 64 rows one round of 16,384
# outputs can pass a few draws in a row; a size whose kernel is the 32-row one passes every draw. About 4M outputs (64 rounds at most, for narrow weights: 1M at 64 rows of
# [1,024 -> 256]) leave such a size no realistic chance.
PROBE_OUTPUTS = 1 << 22
PROBE_MAX_ROUNDS = 64


def probe_rounds(outputs_per_round: int) -> int:
    """Rounds of fresh random rows a probe runs: enough for `PROBE_OUTPUTS` outputs, at most
    `PROBE_MAX_ROUNDS` (a head's single round already compares millions)."""
    return max(1, min(PROBE_MAX_ROUNDS, -(-PROBE_OUTPUTS // outputs_per_round)))


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
    AVX512-BF16 where present). Without them torch's bf16 `F.linear` runs a slow reference path, several
    times the fp32 time (docs/benchmarks.md), and the invariant kernels pack bf16 weights as fp32."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def slow_bf16_gemm_message(dtype: torch.dtype, kernels: str, device_type: str, native: bool) -> str | None:
    """One line with the fix, or None: a bf16 CPU model on its own linears where the CPU lacks a native bf16
    GEMM (`native`) runs every linear on torch's slow bf16 path."""
    if dtype != torch.bfloat16 or kernels == "invariant" or device_type != "cpu" or native:
        return None
    return (
        f"this bf16 model runs kernels='{kernels}' (the model's own linears) on a CPU where oneDNN has no bf16 GEMM (AVX2 only), where "
        "torch's bf16 linears take 5-10x the time of fp32 ones; RolloutConfig(kernels=\"invariant\") runs them "
        "as fp32 GEMMs rounded to bf16, in a fraction of the time (docs/benchmarks.md)"
    )


def warn_if_slow_bf16_gemm(dtype: torch.dtype, kernels: str, device_type: str) -> None:
    """Warn, once per process, where `slow_bf16_gemm_message` has something to say."""
    message = slow_bf16_gemm_message(dtype, kernels, device_type, native_bf16_gemm())
    if message is not None:
        warn_once(message, SlowBf16GemmWarning, stacklevel=4)  # at the line that built the Rollout


@functools.cache  # once per weight shape and process: 6-128 32-row GEMMs
def bf16_blocks_invariant(in_features: int, out_features: int) -> bool:
    """Whether oneDNN's bf16 GEMM on a packed [out, in] weight gives each row of a `ROW_BLOCK`-row block
    bitwise the same output wherever it sits and whatever the other rows are. Probed with random data
    from a private generator (the caller's RNG is untouched): blocks of rows of mixed scales (at least
    three, and `probe_rounds` of them), each against some of the same rows scattered among fresh ones."""
    if not native_bf16_gemm():
        return False
    generator, packed = _probe_weight(in_features, out_features, in_features * 100_003 + out_features)
    kept_counts = (1, ROW_BLOCK // 2, ROW_BLOCK - 1)  # rows of the block placed among fresh ones, in turn
    for index in range(max(3, probe_rounds(ROW_BLOCK // 2 * out_features))):
        kept = kept_counts[index % 3]
        rows = _probe_rows(generator, in_features)
        reference = onednn_linear(rows, packed, None)
        places = torch.randperm(ROW_BLOCK, generator=generator)[:kept]
        mixed = torch.randn(ROW_BLOCK, in_features, generator=generator, dtype=torch.float32).bfloat16()
        mixed[places] = rows[:kept]
        if not torch.equal(onednn_linear(mixed, packed, None)[places], reference[:kept]):
            return False
    return True


@functools.cache  # once per weight shape and process
def bf16_small_blocks_agree(in_features: int, out_features: int) -> bool:
    """Whether 16-row calls of oneDNN's bf16 GEMM give bitwise the rows' outputs inside a 32-row call on
    a packed [out, in] weight (so a decode step of <= 16 rows need not pad to 32 and compute rows it
    throws away); probed like `bf16_blocks_invariant`, which must hold first."""
    if not bf16_blocks_invariant(in_features, out_features):
        return False
    generator, packed = _probe_weight(in_features, out_features, in_features * 7 + out_features * 3)
    for _ in range(max(3, probe_rounds(ROW_BLOCK * out_features))):
        rows = _probe_rows(generator, in_features)
        halves = [onednn_linear(rows[first : first + SMALL_BLOCK], packed, None) for first in (0, SMALL_BLOCK)]
        if not torch.equal(torch.cat(halves), onednn_linear(rows, packed, None)):
            return False
    return True


@functools.cache  # once per group shape and process: the probe runs GEMMs of the group's size
def fused_columns_agree(in_features: int, out_features: tuple[int, ...], has_bias: bool) -> bool:
    """Whether one oneDNN bf16 GEMM block on the concatenated [sum N_i, K] weight gives each member's
    columns bitwise its own GEMM's output in the same `ROW_BLOCK` rows (every bf16 call is made of such
    blocks, so one block shape decides it). Random data, a private generator."""
    generator = torch.Generator().manual_seed(in_features * 31 + sum(out_features))
    weights = [(torch.randn(n, in_features, generator=generator, dtype=torch.float32) * in_features**-0.5).bfloat16()
               for n in out_features]
    biases = [torch.randn(n, generator=generator, dtype=torch.float32).bfloat16() if has_bias else None for n in out_features]
    packs = [torch.ops.mkldnn._reorder_linear_weight(weight, ROW_BLOCK) for weight in weights]
    fused_pack = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights), ROW_BLOCK)
    fused_bias = torch.cat(biases) if has_bias else None  # type: ignore[arg-type]
    for _ in range(max(2, probe_rounds(ROW_BLOCK * sum(out_features)))):
        rows = _probe_rows(generator, in_features)
        alone = [onednn_linear(rows, pack, bias) for pack, bias in zip(packs, biases, strict=True)]
        if not torch.equal(onednn_linear(rows, fused_pack, fused_bias), torch.cat(alone, dim=-1)):
            return False
    return True


# Row counts of one bf16 call for prefill-sized inputs, largest first. One large call streams the weight
# once where 32-row calls stream it once per block, so it is several times faster. Whether it
# gives the rows bitwise their 32-row results depends on the shape and size (on some weights only
# sizes from about the weight's width up, on others nearly every size): hence a ladder of sizes, each
# probed per shape.
LARGE_BLOCKS = (2048, 1536, 1024, 768, 512, 384, 256, 128)
LARGE_BLOCK_MAX_OUT = 16384  # widest weight given LARGE_BLOCKS (a fused gate/up of 2 x 8,192 included)
# Wider weights (output heads) get a shorter ladder: there one call of thousands of rows writes an
# output too large for the caches and is slower than 32-row calls, while a few hundred rows beat both
# (on some heads the probe passes no size, and 32-row calls stay). Two sizes only: each probe builds a
# random weight of the head's shape, once per process (seconds on a large vocabulary), paid by the
# first call of at least that many rows.
HEAD_BLOCKS = (512, 256)
# Row counts of one bf16 call for a decode step of 33-128 rows (a GRPO call's 64 rows): the call padded up
# to the smallest size that passes its probe, instead of 32-row blocks that each stream the whole weight.
# With the weights streamed from DRAM, one 64-row call costs much less than two 32-row calls, and the
# probe passes on most shapes (not on every one); heads included, as at these sizes compute is cheap.
DECODE_BLOCKS = (64, 96, 128)


@functools.cache  # once per weight shape, block size and process
def bf16_large_block_agrees(in_features: int, out_features: int, rows_count: int, has_bias: bool) -> bool:
    """Whether one oneDNN bf16 call over `rows_count` rows on a packed [out, in] weight gives every row
    bitwise its output in `ROW_BLOCK`-row calls (random rows of mixed scales, a private generator)."""
    if not bf16_blocks_invariant(in_features, out_features):
        return False
    generator, packed = _probe_weight(in_features, out_features, in_features * 13 + out_features + rows_count)
    bias = torch.randn(out_features, generator=generator, dtype=torch.float32).bfloat16() if has_bias else None
    for _ in range(probe_rounds(rows_count * out_features)):
        rows = torch.cat([_probe_rows(generator, in_features) for _ in range(rows_count // ROW_BLOCK)])
        blocks = [onednn_linear(rows[first : first + ROW_BLOCK], packed, bias) for first in range(0, rows_count, ROW_BLOCK)]
        if not torch.equal(onednn_linear(rows, packed, bias), torch.cat(blocks)):
            return False
    return True


def _probe_weight(in_features: int, out_features: int, seed: int) -> tuple[torch.Generator, torch.Tensor]:
    """A private generator and a random bf16 [out, in] weight packed for ROW_BLOCK rows."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator, dtype=torch.float32) * in_features**-0.5).bfloat16()
    return generator, torch.ops.mkldnn._reorder_linear_weight(weight, ROW_BLOCK)


def _probe_rows(generator: torch.Generator, in_features: int) -> torch.Tensor:
    """ROW_BLOCK random bf16 rows of scales 1e-2 .. 1e2."""
    scales = 10.0 ** torch.randint(-2, 3, (ROW_BLOCK, 1), generator=generator).float()
    return (torch.randn(ROW_BLOCK, in_features, generator=generator, dtype=torch.float32) * scales).bfloat16()


def onednn_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, K] times a oneDNN-packed [N, K] weight (+ bias [N]) -> [M, N]."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def check_fp32_precision() -> None:
    """Refuse to run fp32 models where oneDNN was told to compute fp32 matmuls in a lower precision."""
    setting = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", "none")
    fpmath = os.environ.get("ONEDNN_DEFAULT_FPMATH_MODE", "").strip().upper()
    if setting not in ("none", "ieee") or fpmath not in ("", "STRICT"):
        raise ValueError(
            f"kernels='invariant' computes fp32 models in strict fp32, but torch.backends.mkldnn.matmul."
            f"fp32_precision={setting!r} and ONEDNN_DEFAULT_FPMATH_MODE={fpmath!r} ask oneDNN for a lower "
            "precision: reset them (fp32_precision='ieee', unset the variable) or use kernels='torch'"
        )
