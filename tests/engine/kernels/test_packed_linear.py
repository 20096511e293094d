"""`kernels="invariant"`: linear layers on oneDNN-prepacked weights.

Oracles: `F.linear` on the same inputs (the values), a row computed alone (batch invariance, bitwise),
single-request HF `generate` (tokens on every route and architecture), and a fresh HF `generate` after
each kind of weight update (the packed copies follow live weights). Negative controls: a deliberately
batch-dependent kernel fails the invariance check, and a `.data` write without `refresh_weights()`
serves the old weights (documented behaviour, so the live-weights test can fail)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_matches_oracle, forget_oracle, mismatches, oracle_batch
from workloads import ARCHS, random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import CostCoefficients
from autobucket.engine.kernels import onednn_probes, packed_linear, packed_matmul
from autobucket.engine.kernels.onednn_probes import bf16_blocks_invariant, onednn_available
from autobucket.engine.kernels.packed_linear import PackedLinears, packed_linears
from autobucket.models import build_tiny_model

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(not onednn_available(torch.float32), reason="no oneDNN on this torch build"),
]

# (K, N) of the linears that matter: bench-qwen2's projections and head, SmolLM2's MLP and head.
SHAPES = [(256, 1024), (1024, 256), (256, 32000), (576, 1536), (1536, 576), (256, 768)]
BUDGET = 6


def invariance_failures(
    kernel, k: int, n: int, batch: int = 32, dtype: torch.dtype = torch.float32
) -> list[str]:
    """Rows whose output inside a batch of `batch` rows differs from the row computed alone, bitwise."""
    generator = torch.Generator().manual_seed(k * 7 + n)
    x = torch.randn(batch, k, generator=generator).to(dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    together = kernel(x, weight, bias)
    failures = []
    for row in (0, 1, batch // 2, batch - 1):
        alone = kernel(x[row : row + 1], weight, bias)
        prefix = kernel(x[: row + 1], weight, bias)[row : row + 1]
        if not torch.equal(alone, together[row : row + 1]) or not torch.equal(prefix, alone):
            failures.append(f"row {row} of {k}x{n}")
    return failures


# fp32 GEMMs on the default kernel (the fixed-order one where it is vectorized) and on oneDNN's, the
# fallback of builds without AVX-512, so both stay covered on any CPU
FP32_KERNELS = pytest.mark.parametrize("fixed_order", [None, False], ids=["default-fp32-kernel", "onednn-fp32"])


@FP32_KERNELS
@pytest.mark.parametrize("k,n", SHAPES)
def test_a_packed_linear_is_batch_invariant_and_equals_f_linear(k, n, fixed_order):
    packs = PackedLinears(fixed_order=fixed_order)
    with torch.inference_mode():
        assert invariance_failures(packs.linear, k, n) == []
        x, weight = torch.randn(5, 3, k), torch.randn(n, k) / k**0.5
        torch.testing.assert_close(packs.linear(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_control_a_batch_dependent_kernel_fails_the_invariance_check():
    def split_k_when_batched(x, weight, bias):  # sums K in two halves once more than one row runs
        if x.shape[0] == 1:
            return F.linear(x, weight, bias)
        half = x.shape[1] // 2
        return F.linear(x[:, :half], weight[:, :half], bias) + F.linear(x[:, half:], weight[:, half:])

    with torch.inference_mode():
        assert invariance_failures(split_k_when_batched, 1536, 576)


needs_bf16_gemm = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no native bf16 GEMM on this CPU"
)


@needs_bf16_gemm
@pytest.mark.parametrize("k,n", SHAPES)
def test_bf16_packs_are_batch_invariant_across_row_blocks_and_close_to_f_linear(k, n):
    """bf16: rows alone, in a prefix and inside 70 rows (three 32-row blocks, the last padded) are
    bitwise equal; the values are a bf16 GEMM's (F.linear's to bf16 rounding)."""
    packs = PackedLinears()
    with torch.inference_mode():
        assert invariance_failures(packs.linear, k, n, batch=70, dtype=torch.bfloat16) == []
        (pack,) = packs._packs.values()
        assert pack.row_blocks == bf16_blocks_invariant(k, n)
        x, weight = torch.randn(5, 3, k).bfloat16(), (torch.randn(n, k) / k**0.5).bfloat16()
        torch.testing.assert_close(packs.linear(x, weight, None), F.linear(x, weight), rtol=2e-2, atol=2e-2)


@needs_bf16_gemm
def test_control_one_bf16_gemm_over_all_rows_depends_on_the_batch():
    """Why the row blocks: on the Intel Xeon (AMX) oneDNN's bf16 GEMM over M rows at once picks its
    kernel by M, so on bench-qwen2's down projection ([M, 1024] x [1024, 256]) three rows run alone
    differ from the same rows inside 114 somewhere; in row blocks they never do. On an AMD EPYC with
    AVX512-BF16 and no AMX, one GEMM was bitwise invariant over M on every shape probed: there the
    control has nothing to show and skips, after the blocked half has run."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(114, 1024, generator=generator).bfloat16()
    weight = (torch.randn(256, 1024, generator=generator) / 32).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)

    def one_gemm(rows):
        return torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")

    packs = PackedLinears()
    with torch.inference_mode():
        whole, blocked = one_gemm(x), packs.linear(x, weight, None)
        starts = range(0, 114, 3)
        assert all(torch.equal(packs.linear(x[i : i + 3], weight, None), blocked[i : i + 3]) for i in starts)
        one_gemm_differs = any(not torch.equal(one_gemm(x[i : i + 3]), whole[i : i + 3]) for i in starts)
    if not one_gemm_differs:
        pytest.skip("oneDNN's bf16 GEMM is batch-invariant over M on this CPU; the control has nothing to show")


# (K, N): bench-qwen2's projections and fused q/k/v, SmolLM2's fused q/k/v, fused gate/up and down
LARGE_SHAPES = [(256, 256), (256, 512), (1024, 256), (576, 960), (576, 3072), (1536, 576)]


@needs_bf16_gemm
@pytest.mark.parametrize("k,n", LARGE_SHAPES)
def test_a_prefill_sized_bf16_call_in_large_blocks_gives_each_row_its_decode_result(k, n):
    """2,700 rows: 2,048 + 512 + 128 rows as single calls where the shape's probe allows them, the rest
    in 32-row blocks. Oracle: every row run alone (a decode step's call), bitwise."""
    generator = torch.Generator().manual_seed(k + n)
    x = (torch.randn(2700, k, generator=generator) * 10.0 ** torch.randint(-2, 3, (2700, 1), generator=generator))
    x, weight = x.bfloat16(), (torch.randn(n, k, generator=generator) / k**0.5).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16()
    packs = PackedLinears()
    with torch.inference_mode():
        whole = packs.linear(x, weight, bias)
        rows = [0, 1, 127, 128, 639, 640, 2047, 2048, 2559, 2560, 2687, 2699]
        alone = torch.cat([packs.linear(x[i : i + 1], weight, bias) for i in rows])
        assert torch.equal(whole[rows], alone)
        in_small_calls = torch.cat([packs.linear(x[i : i + 20], weight, bias) for i in range(0, 2700, 20)])
        assert torch.equal(whole, in_small_calls)
    sizes = packed_matmul.large_blocks_for(2700, k, n, True)  # which large blocks ran: probed ones only
    assert sum(sizes) <= 2700 and all(onednn_probes.bf16_large_block_agrees(k, n, size, True) for size in sizes)
    if all(onednn_probes.bf16_large_block_agrees(k, n, size, True) for size in onednn_probes.LARGE_BLOCKS):
        assert sizes == [2048, 512, 128]  # every size passes (bench-qwen2's shapes, Intel Xeon): greedy


@needs_bf16_gemm
def test_an_output_head_runs_prefill_rows_in_head_blocks_with_each_rows_decode_result():
    """bench-qwen2's head (256 -> 32,000, wider than LARGE_BLOCK_MAX_OUT): 1,100 rows take only the
    probed sizes of the head ladder (at most 512 rows a call), the rest in 32-row blocks. Oracle: every
    row run alone, bitwise."""
    k, n = 256, 32000
    generator = torch.Generator().manual_seed(7)
    x = (torch.randn(1100, k, generator=generator) * 10.0 ** torch.randint(-2, 3, (1100, 1), generator=generator))
    x, weight = x.bfloat16(), (torch.randn(n, k, generator=generator) / k**0.5).bfloat16()
    packs = PackedLinears()
    with torch.inference_mode():
        whole = packs.linear(x, weight, None)
        rows = [0, 1, 511, 512, 1023, 1024, 1099]
        alone = torch.cat([packs.linear(x[i : i + 1], weight, None) for i in rows])
        assert torch.equal(whole[rows], alone)
    sizes = packed_matmul.large_blocks_for(1100, k, n, False)
    assert set(sizes) <= set(onednn_probes.HEAD_BLOCKS) and sum(sizes) <= 1100
    assert all(onednn_probes.bf16_large_block_agrees(k, n, size, False) for size in sizes)


@needs_bf16_gemm
def test_control_large_blocks_the_probe_refuses_would_break_the_oracle(monkeypatch):
    """Why the probe: forced on a shape and size it refuses, a large block changes rows against their
    alone results (skipped where this CPU's GEMM passes every size on every shape)."""
    failing = [(k, n, size) for k, n in LARGE_SHAPES for size in onednn_probes.LARGE_BLOCKS
               if not onednn_probes.bf16_large_block_agrees(k, n, size, False)]  # fmt: skip
    if not failing:
        pytest.skip("every large block passes its probe on this CPU")
    k, n, size = failing[0]
    generator = torch.Generator().manual_seed(size)
    x = (torch.randn(size, k, generator=generator) * 10.0).bfloat16()
    weight = (torch.randn(n, k, generator=generator) / k**0.5).bfloat16()
    monkeypatch.setattr(packed_matmul, "bf16_large_block_agrees", lambda *shape: True)
    packs = PackedLinears()
    with torch.inference_mode():
        forced = packs.linear(x, weight, None)
        in_blocks = torch.cat([packs.linear(x[i : i + 32], weight, None) for i in range(0, size, 32)])
    assert not torch.equal(forced, in_blocks)


@needs_bf16_gemm
@pytest.mark.parametrize("k,n", [*LARGE_SHAPES, (256, 32000)])
def test_a_decode_sized_bf16_call_is_one_padded_call_with_each_rows_alone_result(k, n):
    """33-128 rows (a GRPO decode step's 64): one call padded to the smallest decode block whose probe
    passes, else 32-row blocks. Oracle: every row run alone, bitwise; the block used is a probed one."""
    generator = torch.Generator().manual_seed(k * 3 + n)
    x = (torch.randn(128, k, generator=generator) * 10.0 ** torch.randint(-2, 3, (128, 1), generator=generator))
    x, weight = x.bfloat16(), (torch.randn(n, k, generator=generator) / k**0.5).bfloat16()
    packs = PackedLinears()
    with torch.inference_mode():
        alone = torch.cat([packs.linear(x[i : i + 1], weight, None) for i in range(128)])
        for count in (33, 64, 100, 128):
            assert torch.equal(packs.linear(x[:count], weight, None), alone[:count]), f"{count} rows"
            block = packed_matmul.decode_block_for(count, k, n, False)
            assert block is None or (block >= count and onednn_probes.bf16_large_block_agrees(k, n, block, False))


def test_the_probe_catches_a_call_size_whose_sums_differ_in_rare_last_bits(monkeypatch):
    """A call size whose kernel rounds one output in ~60,000 differently (what [1,024 -> 256] at 64 rows
    does on the Intel Xeon's AMX): the probe refuses it. Control: one round of random rows, what the
    probe compared before, lets such a size through in most draws. Runs on any CPU: a stand-in GEMM."""

    def rarely_off_unless_one_block(rows, weight, bias):  # fp32 sums to bf16; other sizes nudge a few outputs
        out = F.linear(rows.float(), weight.float()).bfloat16()
        if rows.shape[0] != onednn_probes.ROW_BLOCK:
            nudged = torch.rand(out.shape, generator=torch.Generator().manual_seed(int(rows.float().sum()))) < 1.6e-5
            out = torch.where(nudged, (out.float() * (1 + 2**-7)).bfloat16(), out)
        return out

    monkeypatch.setattr(onednn_probes, "bf16_blocks_invariant", lambda k, n: True)
    monkeypatch.setattr(onednn_probes, "_probe_weight", lambda k, n, seed: (torch.Generator().manual_seed(seed),
                        (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5).bfloat16()))  # fmt: skip
    monkeypatch.setattr(onednn_probes, "onednn_linear", rarely_off_unless_one_block)
    probe = onednn_probes.bf16_large_block_agrees.__wrapped__
    assert not probe(1024, 256, 64, False)  # 64 rounds: ~1M outputs compared
    monkeypatch.setattr(onednn_probes, "probe_rounds", lambda outputs: 1)  # control: 16,384 outputs
    passed = sum(probe(1024, 256 + extra, 64, False) for extra in range(8))  # eight fresh draws
    assert passed >= 4, f"one round caught the rare difference in {8 - passed} of 8 draws"


def test_a_shape_failing_the_bf16_probe_runs_fp32_gemms_and_stays_invariant(monkeypatch):
    """Control for the probe: a batch-dependent GEMM must fail it; then packs fall back to fp32 GEMMs
    (the fixed-order kernel on bf16 panels widened as read, else oneDNN's on an fp32 copy)."""

    def noisy_when_batched(rows, packed, bias):
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        return out if rows.shape[0] == 1 else out + torch.randn_like(out) * 1e-3

    with torch.inference_mode():
        # the probes themselves run oneDNN's bf16 GEMM, which a CPU without AVX512-BF16 / AVX-NE-CONVERT
        # lacks (there the probe answers False before any GEMM, and the fallback below is what runs)
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            monkeypatch.setattr(onednn_probes, "onednn_linear", noisy_when_batched)
            assert not bf16_blocks_invariant.__wrapped__(1024, 256)
            monkeypatch.setattr(onednn_probes, "bf16_blocks_invariant", lambda k, n: True)
            assert not onednn_probes.bf16_small_blocks_agree.__wrapped__(1024, 256)  # 16-row calls differ too
            monkeypatch.undo()
        else:
            assert not bf16_blocks_invariant.__wrapped__(1024, 256)
        monkeypatch.setattr(packed_linear, "bf16_blocks_invariant", lambda k, n: False)
        packs = PackedLinears()
        assert invariance_failures(packs.linear, 1024, 256, batch=40, dtype=torch.bfloat16) == []
        (pack,) = packs._packs.values()
        assert not pack.row_blocks and pack.packed.dtype == (torch.bfloat16 if pack.fixed_order else torch.float32)


def test_the_mode_routes_only_this_threads_linears_and_repacks_after_an_update():
    packs, layer = PackedLinears(), torch.nn.Linear(64, 32)
    x = torch.randn(4, 64)
    with torch.inference_mode():
        plain = layer(x)
        with packed_linears(packs):
            packed = layer(x)
        assert packs.packs_made == 1 and packs.nbytes > 0
        torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # bumps the version counter
    with torch.inference_mode(), packed_linears(packs):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-6)
    assert packs.packs_made == 2


# ---- end to end -----------------------------------------------------------------------------------------

ROUTE_CONFIGS = {
    "ordinary": dict(route="ordinary"),
    "aligned": dict(route="aligned", prefill_max_tokens=16),  # chunked
    "bucketed": dict(route="bucketed", costs=CostCoefficients(fixed_ms=1e4)),  # packed
}


def sampling(**fields) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=BUDGET, continuous_batch_size=4, **fields)


@pytest.mark.engine
@pytest.mark.parametrize("route", sorted(ROUTE_CONFIGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_invariant_kernels_match_generate_on_every_route_and_architecture(tiny_models, arch, route):
    model = tiny_models(arch)
    prompts = random_prompts((5, 17, 30, 3, 9, 40), seed=ARCHS.index(arch) + 60)
    tokens, reasons = oracle_batch(model, prompts, BUDGET)
    config = RolloutConfig(kernels="invariant", **ROUTE_CONFIGS[route])
    result = Rollout(model, config=config).generate(prompts, sampling())
    assert_matches_oracle(result, tokens, reasons)
    assert result.profile.packed_weight_bytes > 0


def _step_model():
    return build_tiny_model("tiny-llama", seed=51)


def _generate(rollout, prompts):
    return rollout.generate(prompts, sampling(eos_token_id=[])).tokens


def _first_call(seed: int):
    """(model, prompts, an invariant-kernels Rollout on it, the tokens of its first call)."""
    model, prompts = _step_model(), random_prompts((7, 12, 20), seed=seed)
    rollout = Rollout(model, config=RolloutConfig(route="aligned", kernels="invariant"))
    return model, prompts, rollout, _generate(rollout, prompts)


@pytest.mark.engine
def test_packed_weights_follow_an_optimizer_step_and_load_state_dict():
    model, prompts, rollout, first = _first_call(seed=3)
    assert first == oracle_batch(model, prompts, BUDGET, eos_token_id=[])[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(input_ids=torch.tensor([prompts[0]]), labels=torch.tensor([prompts[0]])).loss
    loss.backward()
    optimizer.step()
    forget_oracle(model)
    stepped = _generate(rollout, prompts)
    assert stepped == oracle_batch(model, prompts, BUDGET, eos_token_id=[])[0] and stepped != first
    model.load_state_dict(_step_model().state_dict())  # back to the first weights, in place
    forget_oracle(model)
    assert _generate(rollout, prompts) == first


@pytest.mark.engine
def test_packed_weights_follow_a_fused_optimizer_step():
    """Fused AdamW (TRL's default) leaves `_version` unchanged; the engine's optimizer-step count repacks."""
    model, prompts, rollout, first = _first_call(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    versions = [p._version for p in model.parameters()]
    model(input_ids=torch.tensor([prompts[2]]), labels=torch.tensor([prompts[2]])).loss.backward()
    optimizer.step()
    assert [p._version for p in model.parameters()] == versions
    forget_oracle(model)
    stepped = _generate(rollout, prompts)
    assert stepped == oracle_batch(model, prompts, BUDGET, eos_token_id=[])[0] and stepped != first


@pytest.mark.engine
def test_a_data_write_needs_refresh_weights():
    model, prompts, rollout, first = _first_call(seed=4)
    other = build_tiny_model("tiny-llama", seed=52)
    for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
        mine.data.copy_(theirs.data)  # bypasses the version counter
    forget_oracle(model)
    fresh = oracle_batch(model, prompts, BUDGET, eos_token_id=[])[0]
    assert mismatches(fresh, first)
    # The documented stale case: embeddings and norms are read live, the linears' old packs still serve.
    assert mismatches(_generate(rollout, prompts), fresh)
    rollout.refresh_weights()
    assert _generate(rollout, prompts) == fresh


def test_invariant_kernels_refuse_a_lowered_fp32_precision(monkeypatch):
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    with pytest.raises(ValueError, match="ONEDNN_DEFAULT_FPMATH_MODE.*kernels='torch'"):
        Rollout(build_tiny_model("tiny-llama"), config=RolloutConfig(kernels="invariant"))


def test_a_precision_lowered_after_the_rollout_was_made_is_refused_at_the_next_call():
    """A trainer turning on bf16 math for its own steps after handing the model over: the next call is
    refused as construction would be, and runs again once the precision is reset."""
    rollout = Rollout(build_tiny_model("tiny-llama"), config=RolloutConfig(route="aligned", kernels="invariant"))
    prompts = random_prompts([5, 9], seed=4)
    before = _generate(rollout, prompts)
    setting = torch.backends.mkldnn.matmul.fp32_precision  # set and reset by hand: monkeypatch's undo
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # leaves torch's precision APIs in a mixed state
    try:
        with pytest.raises(ValueError, match=r"fp32_precision='bf16'.*kernels='torch'"):
            _generate(rollout, prompts)
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = setting
    assert _generate(rollout, prompts) == before


def test_a_bad_kernels_value_names_the_choices():
    with pytest.raises(ValueError, match="kernels='fast' is invalid.*'auto', 'invariant', 'torch', 'hf'"):
        RolloutConfig(kernels="fast")


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_gemm)], ids=["fp32", "bf16"])
@FP32_KERNELS
@pytest.mark.parametrize("k,n", SHAPES)
def test_a_live_weight_gives_bitwise_the_packed_result(k, n, dtype, fixed_order):
    """What `packed_weights_mb` relies on: oneDNN's linear on the plain weight (reordered per call) is
    bitwise its linear on the packed copy, for one row, a block and many rows."""
    generator = torch.Generator().manual_seed(k + n)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype)
    x = torch.randn(70, k, generator=generator).to(dtype)
    packed, unpacked = PackedLinears(fixed_order=fixed_order), PackedLinears(budget_bytes=0, fixed_order=fixed_order)
    with torch.inference_mode():
        for rows in (x[:1], x[:32], x):
            assert torch.equal(packed.linear(rows, weight, None), unpacked.linear(rows, weight, None))
    assert packed.nbytes > 0 and unpacked.nbytes == 0 and unpacked.unpacked_calls == 3


def test_a_packed_weight_budget_bounds_the_copies_and_changes_no_value():
    """Rollouts with no copies, a partial budget and no limit give bitwise the same logprobs, equal to a
    trainer's scoped forward (on the live weights); the copies stay within each budget, also after an
    optimizer step (live weights are read, never stale ones)."""
    from autobucket import invariant
    from autobucket.engine.batching.prefill import positions_from_mask
    from autobucket.engine.trainer_logprobs import teacher_forced_batch, trainer_logprobs

    model = build_tiny_model("tiny-llama")
    prompts = random_prompts([9, 30, 17], seed=4)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=[0, 1, 2], logprobs=True, eos_token_id=[])
    total = sum(p.numel() * 4 for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        runs = {}
        for budget_mb in (0.0, total / 2 / 2**20, None):
            rollout = Rollout(model, config=RolloutConfig(kernels="invariant", packed_weights_mb=budget_mb))
            result = rollout.generate(prompts, sampling)
            assert budget_mb is None or result.profile.packed_weight_bytes <= budget_mb * 2**20
            runs[budget_mb] = result
        logprobs = [run.logprobs for run in runs.values()]
        assert logprobs[0] == logprobs[1] == logprobs[2]
        assert runs[0.0].profile.packed_weight_bytes == 0 < runs[None].profile.packed_weight_bytes
        ids, mask, width = teacher_forced_batch(prompts, runs[None].tokens)
        with torch.no_grad(), invariant(model) as packs:  # the trainer's scope keeps no copies at all
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        assert packs.nbytes == 0 and packs.unpacked_calls > 0
        trainer = trainer_logprobs(logits[:, width - 1 : -1], ids[:, width:]).float()
        for row, values in enumerate(runs[None].logprobs):
            assert trainer[row, : len(values)].tolist() == values
        if step == 0:
            model(input_ids=ids, attention_mask=mask).logits.logsumexp(-1).mean().backward()
            optimizer.step()


def test_a_negative_packed_weight_budget_is_refused():
    with pytest.raises(ValueError, match="packed_weights_mb"):
        RolloutConfig(kernels="invariant", packed_weights_mb=-1.0)
    from autobucket import invariant

    with pytest.raises(ValueError, match="packed_weights_mb"), invariant(build_tiny_model("tiny-llama"), -2.0):
        pass
    bounds_nothing = r"packed_weights_mb=8\.0\) bounds nothing"
    with pytest.warns(DeprecationWarning, match=bounds_nothing), invariant(build_tiny_model("tiny-llama"), 8.0) as packs:
        pass
    assert packs.budget_bytes == 0
