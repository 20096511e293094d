"""The Triton kernel set, on the CPU through Triton's interpreter (fp32, toy sizes): each kernel against
torch to tolerance, and for batch invariance bitwise, each with a negative control that must break it;
and every kernel compiled ahead of time for sm_80 and sm_90.

The interpreter runs `tl.dot` through numpy, whose BLAS rounds a row by its place in the tile: the
`tl.dot` form of the linear is compared with a row kept at the same tile position; the in-order form the
interpreter runs by default is compared with the row anywhere."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels then run on CPU tensors

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from autobucket.engine.kernels.triton.attention import causal_counts, key_order, launch_attention  # noqa: E402
from autobucket.engine.kernels.triton.linear import invariant_linear, launch_linear  # noqa: E402
from autobucket.engine.kernels.triton.row_reductions import launch_logsumexp, log_softmax_at, rms_norm  # noqa: E402
from autobucket.engine.kernels.triton.selection import first_argmax, sample_inverse_cdf  # noqa: E402
from autobucket.engine.kernels.triton.tiles import LINEAR_TILES, LinearTiles  # noqa: E402

SRC = Path(__file__).resolve().parents[3] / "src"
FP32 = LINEAR_TILES[torch.float32]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(seed))


# ------------------------------------------------------------------ linear
def test_linear_matches_torch_in_float64_as_closely_as_torch():
    x, weight, bias = randn(37, 96, seed=1), randn(200, 96, seed=2), randn(200, seed=3)
    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    ours = (invariant_linear(x, weight, bias).double() - exact).abs().max().item()
    torch_error = (torch.nn.functional.linear(x, weight, bias).double() - exact).abs().max().item()
    assert ours <= 4 * torch_error + 1e-6
    assert (invariant_linear(x, weight, -bias).double() - exact).abs().max().item() > 1.0  # control: wrong bias


def test_linear_row_is_bitwise_the_same_alone_and_anywhere_in_a_batch():
    x, weight, bias = randn(150, 96, seed=4), randn(70, 96, seed=5), randn(70, seed=6)
    batch = invariant_linear(x, weight, bias)
    for row in (0, 5, 127, 128, 149):
        assert torch.equal(invariant_linear(x[row : row + 1], weight, bias)[0], batch[row])
        assert torch.equal(invariant_linear(x[row:], weight, bias)[0], batch[row])
    other_k = launch_linear(x, weight, bias, LinearTiles(FP32.block_m, FP32.block_n, FP32.block_k // 2, 8))
    assert (other_k != batch).any(dim=1).sum().item() > 140  # control: BLOCK_K changed


def test_linear_tl_dot_form_is_invariant_at_a_fixed_tile_position():
    """The GPU's form (`tl.dot`): row r of a batch of 10 and row r + 128 of a batch of 150 sit at the same
    place in their tiles, so their bits agree; the control changes BLOCK_K."""
    x, weight = randn(150, 96, seed=7), randn(70, 96, seed=8)
    small, large = launch_linear(x[:10], weight, None, in_order=False), launch_linear(
        torch.cat([x[10:138], x[:10], x[138:140]]), weight, None, in_order=False
    )
    assert torch.equal(small, large[128:138])
    other_k = launch_linear(x[:10], weight, None, LinearTiles(128, 128, 16, 8), in_order=False)
    assert not torch.equal(small, other_k)


def test_linear_reads_a_transposed_weight_in_place_and_gives_ordinary_gradients():
    x = randn(9, 32, seed=9).requires_grad_()
    stored = randn(32, 24, seed=10).requires_grad_()  # Conv1D's layout: weight.T is the linear's weight
    out = invariant_linear(x, stored.t(), None)
    torch.testing.assert_close(out, x @ stored, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    grads = (x.grad.clone(), stored.grad.clone())
    x.grad = stored.grad = None
    (x @ stored).square().sum().backward()
    torch.testing.assert_close(grads[0], x.grad)
    torch.testing.assert_close(grads[1], stored.grad)


# ------------------------------------------------------------------ attention
def reference(query, key, value, allowed, scale):
    """SDPA with `allowed` [rows, queries, columns] -> [rows, queries, heads, D]; no key: zeros."""
    has = allowed.any(-1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=(allowed | ~has[..., None])[:, None], scale=scale, enable_gqa=True
    )
    return (out * has[:, None, :, None]).transpose(1, 2)


def test_attention_matches_sdpa_with_padding_gaps_and_an_empty_query():
    rows, heads, kv_heads, queries, columns, dim = 3, 4, 2, 21, 150, 16
    query, key, value = randn(rows, heads, queries, dim, seed=11), randn(rows, kv_heads, columns, dim, seed=12), randn(
        rows, kv_heads, columns, dim, seed=13
    )
    allowed = torch.ones(rows, queries, columns, dtype=torch.bool).tril(columns - queries)
    allowed[0, :, :7] = False  # left padding
    allowed[1, :, 40:60] = False  # a gap
    allowed[2, 3] = False  # a query with no key
    order, count = key_order(allowed)
    out = launch_attention(query, key, value, order, count, 0.25)
    torch.testing.assert_close(out, reference(query, key, value, allowed, 0.25), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2, 3], torch.zeros_like(out[2, 3]))
    wrong = allowed.clone()
    wrong[1, :, 40:60] = True
    assert (reference(query, key, value, wrong, 0.25) - out).abs().max() > 1e-3  # control: the gap read


def test_attention_causal_without_a_mask_matches_sdpa():
    query, key = randn(2, 4, 9, 16, seed=14), randn(2, 4, 40, 16, seed=15)
    out = launch_attention(query, key, key, None, causal_counts(2, 9, 40, True, query.device), 0.3)
    allowed = torch.ones(2, 9, 40, dtype=torch.bool).tril(31)
    torch.testing.assert_close(out, reference(query, key, key, allowed, 0.3), rtol=1e-5, atol=1e-5)


SEQUENCE = 75  # tokens of the one sequence every form below attends over (several key blocks)


def one_sequence(seed: int = 16):
    """q [1, 4, L, 16], k/v [1, 2, L, 16] of one sequence."""
    return randn(1, 4, SEQUENCE, 16, seed=seed), randn(1, 2, SEQUENCE, 16, seed=seed + 1), randn(
        1, 2, SEQUENCE, 16, seed=seed + 2
    )


def in_cache(tensor: torch.Tensor, offset: int, columns: int) -> torch.Tensor:
    """tensor [1, H, L, D] placed at columns offset.. of a [1, H, columns, D] cache of noise."""
    cache = randn(1, tensor.shape[1], columns, tensor.shape[3], seed=99) * 50
    cache[:, :, offset : offset + tensor.shape[2]] = tensor
    return cache


def forms(query, key, value, block_n: int, window: int = 0, attention=launch_attention):
    """The one sequence's attention output [L, heads, D] computed four ways: one-shot prefill; chunked
    prefill over a cached prefix (chunks of 20); decode, each query alone over a right-aligned cache whose
    sequence starts at column 13 with noise before it; and packed with another sequence in one row."""
    length = query.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if window:
        causal &= ~torch.ones(length, length, dtype=torch.bool).tril(-window)

    def run(q, k, v, allowed):
        order, count = key_order(allowed)
        return attention(q, k, v, order, count, 0.25, block_n)

    one_shot = run(query, key, value, causal[None])[0]
    chunks = [run(query[:, :, s : s + 20], key[:, :, : s + 20], value[:, :, : s + 20], causal[None, s : s + 20, : s + 20])[0]
              for s in range(0, length, 20)]  # fmt: skip
    offset, columns = 13, length + 30
    k_cache, v_cache = in_cache(key, offset, columns), in_cache(value, offset, columns)
    decode = []
    for position in range(length):
        allowed = torch.zeros(1, 1, columns, dtype=torch.bool)
        allowed[0, 0, offset : offset + length] = causal[position]
        decode.append(run(query[:, :, position : position + 1], k_cache, v_cache, allowed)[0])
    other = 17  # tokens of a second sequence packed in front of this one in the same row
    packed_q = torch.cat([randn(1, 4, other, 16, seed=50), query], dim=2)
    packed_k, packed_v = torch.cat([randn(1, 2, other, 16, seed=51), key], 2), torch.cat([randn(1, 2, other, 16, seed=52), value], 2)
    block_diagonal = torch.zeros(other + length, other + length, dtype=torch.bool)
    block_diagonal[:other, :other] = torch.ones(other, other, dtype=torch.bool).tril()
    block_diagonal[other:, other:] = causal
    packed = run(packed_q, packed_k, packed_v, block_diagonal[None])[0, other:]
    return one_shot, torch.cat(chunks), torch.cat(decode), packed


@pytest.mark.parametrize("window", [0, 24], ids=["full", "window"])
def test_attention_is_bitwise_the_same_in_every_form(window):
    query, key, value = one_sequence()
    one_shot, chunked, decode, packed = forms(query, key, value, 32, window)
    assert torch.equal(one_shot, chunked)
    assert torch.equal(one_shot, decode)
    assert torch.equal(one_shot, packed)
    allowed = torch.ones(SEQUENCE, SEQUENCE, dtype=torch.bool).tril()
    if window:
        allowed &= ~torch.ones(SEQUENCE, SEQUENCE, dtype=torch.bool).tril(-window)
    torch.testing.assert_close(one_shot[None], reference(query, key, value, allowed[None], 0.25), rtol=1e-5, atol=1e-5)


def test_attention_forms_control_blocks_that_move_break_the_equality():
    """Controls: the decode and the chunks walk blocks of 16 keys where the one-shot prefill walks 32
    (what counting blocks from another start does to a query's sums), and torch's own SDPA over the same
    four forms: both change bits."""
    query, key, value = one_sequence()
    one_shot = forms(query, key, value, 32)[0]
    _, chunked, decode, packed = forms(query, key, value, 16)
    assert (chunked != one_shot).any(dim=-1).sum().item() > SEQUENCE
    assert (decode != one_shot).any(dim=-1).sum().item() > SEQUENCE

    def sdpa_from_order(q, k, v, order, count, scale, block_n):  # the allowed mask rebuilt from the order
        taken = torch.arange(k.shape[2])[None, None, :] < count[..., None]
        allowed = torch.zeros(order.shape, dtype=torch.bool).scatter(-1, order.long(), taken)
        return reference(q, k, v, allowed.expand(q.shape[0], q.shape[2], -1), scale)

    sdpa = forms(query, key, value, 32, attention=sdpa_from_order)
    assert any(not torch.equal(sdpa[0], form) for form in sdpa[1:])


def test_attention_query_is_the_same_alone_and_in_a_batch_of_rows():
    query, key, value = randn(6, 4, 1, 16, seed=20), randn(6, 2, 90, 16, seed=21), randn(6, 2, 90, 16, seed=22)
    lengths = torch.tensor([90, 3, 47, 64, 65, 1])
    allowed = (torch.arange(90)[None, :] >= 90 - lengths[:, None])[:, None]  # right-aligned rows
    order, count = key_order(allowed)
    batch = launch_attention(query, key, value, order, count, 0.25)
    for row in range(6):
        alone = launch_attention(query[row : row + 1], key[row : row + 1], value[row : row + 1], order[row : row + 1], count[row : row + 1], 0.25)
        assert torch.equal(alone[0], batch[row])


# ------------------------------------------------------------------ row reductions
def test_rms_norm_matches_the_llama_formula_and_is_per_row():
    x, weight = randn(13, 96, seed=30), randn(96, seed=31)
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    out = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(rms_norm(x[r : r + 1], weight, 1e-6)[0], out[r]) for r in range(13))
    assert (rms_norm(x, weight, 1.0) - expected).abs().max() > 1e-2  # control: another epsilon


def test_logsumexp_and_log_softmax_at_match_torch_and_are_per_row():
    logits = randn(9, 3000, seed=32) * 4
    out = launch_logsumexp(logits)
    torch.testing.assert_close(out, logits.logsumexp(-1), rtol=1e-6, atol=1e-5)
    assert all(torch.equal(launch_logsumexp(logits[r : r + 1])[0], out[r]) for r in range(9))
    tokens = torch.randint(0, 3000, (9,), generator=generator(33))
    expected = logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(log_softmax_at(logits, tokens), expected, rtol=1e-6, atol=1e-5)
    assert not torch.equal(launch_logsumexp(logits, block=512), out)  # control: another block changes the sum


# ------------------------------------------------------------------ selection
def test_first_argmax_is_torch_argmax_with_ties_across_blocks():
    logits = randn(6, 3000, seed=34)
    logits[1, 5] = logits[1, 2500] = 50.0  # a tie in different blocks: the first wins
    logits[2, 1030] = logits[2, 1031] = 50.0  # a tie inside a block
    assert torch.equal(first_argmax(logits), logits.argmax(-1))
    assert not torch.equal(first_argmax(logits.flip(-1)), logits.argmax(-1))  # control


def test_inverse_cdf_is_the_first_index_past_u_times_the_total():
    weights = torch.softmax(randn(8, 3000, seed=35), -1)
    weights[3, 2000:] = 0.0  # zero-weight tail: never chosen
    uniforms = torch.rand(8, generator=generator(36))
    uniforms[3] = 0.999999
    cdf = weights.double().cumsum(-1)
    expected = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1])[:, None], right=True)[:, 0]
    chosen = sample_inverse_cdf(weights, uniforms)
    assert torch.equal(chosen, expected)
    assert chosen[3] < 2000
    assert not torch.equal(sample_inverse_cdf(weights, (uniforms + 0.3) % 1.0), expected)  # control


# ------------------------------------------------------------------ ahead-of-time GPU compile
def test_every_kernel_compiles_for_sm80_and_sm90_without_a_gpu():
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = f"{SRC}{os.pathsep}{environment.get('PYTHONPATH', '')}"
    done = subprocess.run(
        [sys.executable, "-m", "autobucket.engine.kernels.triton.ahead_of_time", "80", "90"],
        env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    from autobucket.engine.kernels.triton.ahead_of_time import kernel_specs

    assert len(lines) == 2 * len(list(kernel_specs())) and all("cubin" in line and int(line.split()[-2]) > 1000 for line in lines), lines
