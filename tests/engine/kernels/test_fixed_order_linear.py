"""`fixed_order_linear`, the fp32 linear of `kernels="invariant"` on AVX-512 and AVX2 builds.

Its contract: every output is one fused multiply-add chain over k = 0 .. K-1 in order, then + bias. The
oracle computes that chain in float64: a product of two fp32 values is exact there, and each step's sum
is rounded to fp32, as an fp32 FMA rounds it (up to double rounding, a ~2^-29 chance per step that the
fixed seeds here do not meet). So any other order of the sum, a split of K, a lost partial sum between
K slices or a wrong column of a panel fails it. A negative control shows the oracle tells orders
apart: the same products summed starting from the middle of K differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autobucket.engine.kernels import packed_linear
from autobucket.engine.kernels.packed_linear import PackedLinears
from autobucket.engine.kernels.packed_matmul import fixed_order_op, fixed_order_panels, panel_bytes

pytestmark = pytest.mark.usefixtures("single_thread")


def _kernel():
    op = fixed_order_op()
    if op is None:
        pytest.skip("the kernel library has no vector build here (oneDNN's fp32 GEMM serves)")
    return op


def fma_chain(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, order=None) -> torch.Tensor:
    """out[m, n] = fl(... fl(fl(x[m,0] w[n,0]) + x[m,1] w[n,1]) ...) + bias[n], each step one rounding.
    `order`: the k indices in the order summed (default 0 .. K-1)."""
    rows64, weight64 = rows.double(), weight.double()
    acc = torch.zeros(rows.shape[0], weight.shape[0], dtype=torch.float32)
    for k in order if order is not None else range(rows.shape[1]):
        acc = (rows64[:, k : k + 1] * weight64[:, k] + acc.double()).float()
    return acc if bias is None else acc + bias


def _case(rows: int, in_features: int, out_features: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    scales = 10.0 ** torch.randint(-2, 3, (rows, 1), generator=generator)
    x = torch.randn(rows, in_features, generator=generator) * scales
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    return x, weight, torch.randn(out_features, generator=generator)


# rows across tiles (12, and pair tiles of 6 from 33 rows on) and blocks (120); K across the 256-long
# slices; N with a partial last panel; (100, 300, 100): pair tiles, then a single one for the partial panel;
# AVX2 calls of 512+ rows read their rows from per-tile micro-panels, (600, 1100, 40) in blocks of 54 rows
# (an L2-sized share at that K) with a partial last one
@pytest.mark.parametrize(
    "rows,in_features,out_features",
    [(1, 16, 32), (13, 300, 70), (130, 64, 33), (25, 520, 96), (100, 300, 100), (600, 1100, 40)],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_each_output_is_the_fma_chain_over_k_in_order(rows, in_features, out_features, with_bias):
    kernel = _kernel()
    x, weight, bias = _case(rows, in_features, out_features, seed=rows + in_features + out_features)
    bias = bias if with_bias else None
    out = kernel(x, fixed_order_panels(weight), bias, out_features)
    assert torch.equal(out, fma_chain(x, weight, bias))


@pytest.mark.parametrize(
    "rows,in_features,out_features",
    [(1, 16, 32), (13, 300, 70), (64, 256, 1000), (130, 64, 33), (100, 300, 100), (600, 1100, 40)],
)
def test_bf16_panels_give_the_chain_of_the_widened_weight(rows, in_features, out_features):
    """A bf16 weight's panels stay bf16 and are widened as the kernel reads them: every tile form (pair
    tiles, micro-panels, partial panels, K slices, the next slices' prefetch of a decode-sized call)
    gives each output the chain over the exactly widened weight, in half the bytes."""
    kernel = _kernel()
    x, weight, bias = _case(rows, in_features, out_features, seed=3 * rows + out_features)
    weight = weight.bfloat16()
    panels = fixed_order_panels(weight)
    assert panels.dtype == torch.bfloat16 and panels.nbytes == panel_bytes(out_features, in_features, torch.bfloat16)
    assert panels.nbytes * 2 == fixed_order_panels(weight.float()).nbytes
    expected = fma_chain(x, weight.float(), bias)
    assert torch.equal(kernel(x, panels, bias, out_features), expected)
    assert torch.equal(kernel(x, fixed_order_panels(weight.float()), bias, out_features), expected)
    # control: the chain of the weight before its rounding to bf16 is another result
    x_fp32_weight = fma_chain(x, _case(rows, in_features, out_features, seed=3 * rows + out_features)[1], bias)
    assert not torch.equal(kernel(x, panels, bias, out_features), x_fp32_weight)


@pytest.mark.parametrize(
    "rows,in_features,out_features", [(1, 16, 32), (13, 300, 70), (64, 256, 1000), (130, 64, 33), (600, 1100, 40)]
)
@pytest.mark.parametrize("panel_dtype", [torch.float32, torch.bfloat16])
def test_bf16_outputs_are_the_fp32_outputs_rounded_as_torch_rounds_them(rows, in_features, out_features, panel_dtype):
    """`fixed_order_linear_bf16` (a bf16 model's linears): bitwise `fixed_order_linear(...).to(bfloat16)`,
    the rounding done as the kernel copies each block out instead of over an fp32 output afterwards."""
    kernel = _kernel()
    x, weight, bias = _case(rows, in_features, out_features, seed=5 * rows + in_features)
    panels = fixed_order_panels(weight.to(panel_dtype))
    expected = kernel(x, panels, bias, out_features).to(torch.bfloat16)
    out = torch.ops.autobucket.fixed_order_linear_bf16(x, panels, bias, out_features)
    assert out.dtype == torch.bfloat16 and torch.equal(out.view(torch.int16), expected.view(torch.int16))
    # control: truncating instead of rounding to nearest gives other bits
    truncated = (kernel(x, panels, bias, out_features).view(torch.int32) >> 16).to(torch.int16)
    assert not torch.equal(out.view(torch.int16), truncated)


def test_no_inputs_give_the_bias_in_a_tensor_of_its_own():
    _kernel()
    x, bias, panels = torch.randn(3, 0), torch.randn(40), torch.empty(2, 0, 32)
    for op, dtype in ((torch.ops.autobucket.fixed_order_linear, torch.float32),
                      (torch.ops.autobucket.fixed_order_linear_bf16, torch.bfloat16)):  # fmt: skip
        out = op(x, panels, bias, 40)
        assert out.dtype == dtype and torch.equal(out, bias.expand(3, 40).to(dtype)) and out.is_contiguous()
        out.zero_()  # the caller's to write: never the bias itself
        assert bias.abs().sum() > 0


def test_bf16_rounding_of_special_values_is_torchs():
    """Ties (to even), values that round up to inf, inf, NaN (any payload), subnormals and signed zeros,
    placed in the outputs through a bias with a zero weight: torch's `.to(torch.bfloat16)` bits, NaNs
    included (0xFFFF from ATen's vectorized conversion)."""
    kernel = _kernel()
    ties = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 2.0**-130 + 2.0**-137]
    special = [float("inf"), float("-inf"), float("nan"), -float("nan"), 3.3895e38, -3.3895e38, 0.0, -0.0, 1e-40]
    payload_nan = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32).item()
    values = torch.tensor(ties + special + [payload_nan] + torch.randn(30).tolist(), dtype=torch.float32)
    bias = values.repeat(2)[: 2 * 32]  # 64 outputs: two whole panels (the 16-wide vector path) ...
    for out_features in (64, 45):  # ... and a partial panel (the scalar tail)
        x, weight = torch.randn(3, 8), torch.zeros(out_features, 8)
        panels, column_bias = fixed_order_panels(weight), bias[:out_features].contiguous()
        expected = kernel(x, panels, column_bias, out_features).to(torch.bfloat16)
        out = torch.ops.autobucket.fixed_order_linear_bf16(x, panels, column_bias, out_features)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), out_features


# the unpacked kernel: calls of <= 16 rows (24 outputs a tile) and more (12), a last block of one vector,
# rows across its 256-row chunks, N with a partial last tile, K of 1
@pytest.mark.parametrize(
    "rows,in_features,out_features",
    [(1, 16, 32), (7, 1, 5), (16, 300, 70), (17, 64, 25), (40, 96, 13), (130, 64, 33), (300, 40, 24)],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_unpacked_kernel_gives_each_output_the_chain_from_the_weight_itself(
    rows, in_features, out_features, with_bias
):
    """`fixed_order_linear_unpacked` (linears past the packed-weight budget): the same chains from the
    [N, K] weight, bitwise the panels' kernel."""
    kernel = _kernel()
    x, weight, bias = _case(rows, in_features, out_features, seed=rows * in_features + out_features)
    bias = bias if with_bias else None
    out = torch.ops.autobucket.fixed_order_linear_unpacked(x, weight, bias)
    assert torch.equal(out, fma_chain(x, weight, bias))
    assert torch.equal(out, kernel(x, fixed_order_panels(weight), bias, out_features))
    # a bf16 weight is read as it is, widened as broadcast: the chain of the widened weight, no fp32 copy
    bf16_weight = weight.bfloat16()
    bf16_out = torch.ops.autobucket.fixed_order_linear_unpacked(x, bf16_weight, bias)
    assert torch.equal(bf16_out, fma_chain(x, bf16_weight.float(), bias))
    assert torch.equal(bf16_out, kernel(x, fixed_order_panels(bf16_weight), bias, out_features))


def test_a_linear_past_the_budget_runs_the_unpacked_kernel_on_the_live_weight():
    _kernel()
    packs = PackedLinears(budget_bytes=0)
    x, weight, bias = _case(9, 96, 40, seed=8)
    with torch.inference_mode():
        assert torch.equal(packs.linear(x, weight, bias), fma_chain(x, weight, bias))
        weight.mul_(-1.0)  # read live: nothing to repack
        assert torch.equal(packs.linear(x, weight, bias), fma_chain(x, weight, bias))
    assert packs.nbytes == 0 and packs.unpacked_calls == 2 and packs.packs_made == 0


def test_a_bf16_linear_past_the_budget_reads_its_bf16_weight_in_place():
    _kernel()
    packs = PackedLinears(budget_bytes=0, fixed_order=True)
    x, weight, bias = (t.bfloat16() for t in _case(9, 96, 40, seed=9))
    with torch.inference_mode():
        out = packs.linear(x, weight, bias)
        if packs.unpacked_calls == 0:
            pytest.skip("this CPU runs bf16 linears on oneDNN's bf16 GEMM (row blocks)")
        assert torch.equal(out, fma_chain(x.float(), weight.float(), bias.float()).bfloat16())
    assert packs.nbytes == 0 and packs.packs_made == 0


def test_staged_and_direct_stores_of_aliased_rows_give_the_chain():
    """Output rows a multiple of 4 KB apart (N = 1,024) in a call of many rows: AMD CPUs compute them
    through a staging buffer, others store them directly. Both are the same chains, whichever this CPU
    picks, so both are checked here."""
    _kernel()
    x, weight, bias = _case(130, 256, 1024, seed=17)
    panels, expected = fixed_order_panels(weight), fma_chain(x, weight, bias)
    for stage_aliased_rows in (True, False):
        out = torch.ops.autobucket.fixed_order_linear_staging(x, panels, bias, 1024, stage_aliased_rows)
        assert torch.equal(out, expected), stage_aliased_rows


def test_control_another_order_of_the_same_sum_differs():
    kernel = _kernel()
    x, weight, _ = _case(13, 300, 70, seed=3)
    halves = list(range(150, 300)) + list(range(150))  # the same products, summed from the middle
    out = kernel(x, fixed_order_panels(weight), None, 70)
    assert not torch.equal(out, fma_chain(x, weight, None, order=halves))


def test_a_row_gets_the_same_output_alone_anywhere_in_any_batch_and_thread_count():
    kernel = _kernel()
    x, weight, bias = _case(200, 256, 1000, seed=11)
    panels = fixed_order_panels(weight)
    together = kernel(x, panels, bias, 1000)
    shuffled = torch.randperm(200, generator=torch.Generator().manual_seed(2))
    assert torch.equal(kernel(x[shuffled], panels, bias, 1000), together[shuffled])
    for row in (0, 11, 12, 119, 120, 199):
        assert torch.equal(kernel(x[row : row + 1], panels, bias, 1000), together[row : row + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(kernel(x, panels, bias, 1000), together)
    finally:
        torch.set_num_threads(threads)


def test_packed_fp32_linears_run_it_and_follow_a_weight_update():
    _kernel()
    packs = PackedLinears()
    x, weight, bias = _case(9, 96, 40, seed=5)
    with torch.inference_mode():
        first = packs.linear(x, weight, bias)
        pack = packs._packs[id(weight)]
        assert pack.fixed_order and pack.packed.shape == (2, 96, 32)
        assert torch.equal(first, fma_chain(x, weight, bias))
        storage = pack.packed.data_ptr()
        weight.mul_(0.5)  # an in-place update: the next call repacks, into the same panels
        assert torch.equal(packs.linear(x, weight, bias), fma_chain(x, weight, bias))
        assert packs._packs[id(weight)] is pack and pack.packed.data_ptr() == storage
        weight.data.mul_(2.0)  # a write the version counter misses: refresh() marks the panels stale
        packs.refresh()
        assert torch.equal(packs.linear(x, weight, bias), fma_chain(x, weight, bias))
        assert pack.packed.data_ptr() == storage and packs.packs_made == 3


@pytest.mark.parametrize("out_features", [32, 45, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panels_rewritten_in_place_equal_fresh_ones_tail_zeroed(out_features, dtype):
    """A repack writes over the old panels: every column (the last panel's past N included, which the
    kernel reads) must be the fresh layout's, whatever the storage held."""
    weight = torch.randn(out_features, 24, generator=torch.Generator().manual_seed(out_features)).to(dtype)
    fresh = fixed_order_panels(weight)
    assert fresh.dtype == dtype and fresh.shape == (-(-out_features // 32), 24, 32)  # bf16 panels stay bf16
    reference = torch.nn.functional.pad(weight, (0, 0, 0, -out_features % 32)).view(-1, 32, 24).transpose(1, 2)
    assert torch.equal(fresh, reference)
    stale = torch.full_like(fresh, float("nan"))
    assert fixed_order_panels(weight, out=stale) is stale and torch.equal(stale, fresh)


def test_packed_bf16_linears_hold_bf16_panels_where_they_run_the_fixed_order_kernel():
    """Where a bf16 weight runs the fixed-order kernel (CPUs without a trusted bf16 GEMM), its pack holds
    bf16 panels: half the bytes of the fp32 ones it held before, the same values (the chain of the
    widened weight, rounded to bf16 as the linear's output)."""
    _kernel()
    packs = PackedLinears(fixed_order=True)
    x, weight, bias = _case(9, 96, 40, seed=6)
    x, weight, bias = x.bfloat16(), weight.bfloat16(), bias.bfloat16()
    with torch.inference_mode():
        out = packs.linear(x, weight, bias)
        pack = packs._packs[id(weight)]
        if not pack.fixed_order:
            pytest.skip("this CPU runs bf16 linears on oneDNN's bf16 GEMM (row blocks)")
        assert pack.packed.dtype == torch.bfloat16 and packs.nbytes == panel_bytes(40, 96, torch.bfloat16)
        assert torch.equal(out, fma_chain(x.float(), weight.float(), bias.float()).bfloat16())
        weight.mul_(0.5)  # an in-place update: repacked into the same bf16 panels
        assert torch.equal(packs.linear(x, weight, bias), fma_chain(x.float(), weight.float(), bias.float()).bfloat16())
        assert packs._packs[id(weight)] is pack and pack.packed.dtype == torch.bfloat16


def test_packed_panels_of_a_reshaped_weight_are_made_anew():
    _kernel()
    packs = PackedLinears()
    x, weight, _ = _case(3, 64, 40, seed=2)
    with torch.inference_mode():
        packs.linear(x, weight, None)
        old = packs._packs[id(weight)].packed
        weight.data = torch.randn(72, 64)  # another shape behind the same parameter (then refresh_weights)
        packs.refresh()
        assert torch.equal(packs.linear(x, weight, None), fma_chain(x, weight, None))
        assert packs._packs[id(weight)].packed.shape == (3, 64, 32) and old.shape == (2, 64, 32)


def test_bad_panels_are_refused_with_the_expected_layout():
    kernel = _kernel()
    x, weight, _ = _case(4, 64, 40, seed=1)
    with pytest.raises(RuntimeError, match=r"panels \[ceil\(N / 32\), K, 32\]"):
        kernel(x, weight, None, 40)


# (form, flags on top of the library's): the portable std::fma loops, and the AVX2 tiles (on an AVX-512
# CPU a second vector form; on an AVX2 CPU the library's own)
OTHER_BUILDS = [("portable", ["-mno-avx512f", "-mno-avx2"]), ("avx2", ["-mno-avx512f"])]


@pytest.mark.parametrize("form,extra_flags", OTHER_BUILDS, ids=[form for form, _ in OTHER_BUILDS])
def test_every_build_gives_the_same_values(tmp_path, form, extra_flags):
    """The contract holds across builds: the portable `std::fma` loop and the AVX2 tiles give bitwise
    the library's tiles' outputs (so a rollout and a trainer on CPUs of different kinds agree on these
    linears), the packed kernel and the unpacked one. Builds each form under its own library name
    (~20 s once, then cached)."""
    import hashlib

    from torch.utils import cpp_extension

    kernel = _kernel()
    if form == "avx2" and "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2")
    csrc = Path(packed_linear.__file__).parent / "csrc"
    source = (csrc / "fixed_order_linear.cpp").read_text()
    header = (csrc / "cpu_vendor.h").read_text()  # included by the source, so copied beside it
    namespace = f"autobucket_{form}_check"
    source = source.replace("TORCH_LIBRARY_FRAGMENT(autobucket,", f"TORCH_LIBRARY({namespace},")
    source = source.replace("TORCH_LIBRARY_IMPL(autobucket,", f"TORCH_LIBRARY_IMPL({namespace},")
    path = tmp_path / f"{form}.cpp"
    path.write_text(source)
    (tmp_path / "cpu_vendor.h").write_text(header)
    flags = ["-O3", "-march=native", *extra_flags, "-ffp-contract=off"]
    digest = hashlib.sha256(f"{source}|{header}|{flags}|{torch.__version__}".encode()).hexdigest()[:12]
    if not hasattr(torch.ops, namespace) or not hasattr(getattr(torch.ops, namespace), "fixed_order_linear"):
        cpp_extension.load(name=f"{namespace}_{digest}", sources=[str(path)], extra_cflags=flags,
                           is_python_module=False, verbose=False)  # fmt: skip
    other = getattr(torch.ops, namespace)
    assert other.fixed_order_linear_vectorized() == (form == "avx2")
    for rows, in_features, out_features in [(29, 300, 70), (7, 520, 33), (130, 64, 96)]:
        x, weight, bias = _case(rows, in_features, out_features, seed=rows)
        panels = fixed_order_panels(weight)
        expected = kernel(x, panels, bias, out_features)
        assert torch.equal(other.fixed_order_linear(x, panels, bias, out_features), expected)
        bf16_panels = fixed_order_panels(weight.bfloat16())  # widened as read, in every form alike
        bf16_expected = kernel(x, bf16_panels, bias, out_features)
        assert torch.equal(other.fixed_order_linear(x, bf16_panels, bias, out_features), bf16_expected)
        rounded = torch.ops.autobucket.fixed_order_linear_bf16(x, bf16_panels, bias, out_features)
        assert torch.equal(other.fixed_order_linear_bf16(x, bf16_panels, bias, out_features).view(torch.int16),
                           rounded.view(torch.int16))  # fmt: skip
        if form == "avx2":  # the portable build registers no unpacked kernel
            assert torch.equal(other.fixed_order_linear_unpacked(x, weight, bias), expected)
            assert torch.equal(other.fixed_order_linear_unpacked(x, weight.bfloat16(), bias), bf16_expected)
