"""The trainer's reductions as kernel ops (`engine/kernels/trainer_reductions.py`) against their oracles,
torch's own ops (what TRL's `selective_log_softmax` calls): the fp32 logsumexp bitwise `torch.logsumexp`,
the bf16 log-probability at a token bitwise `torch.log_softmax(...).gather`, on vocabularies with and without
vector tails, past ATen's cascade levels, Qwen2.5's vocabulary, 1, 3 and 64 rows, 1 and 2 threads, rows with
some, all or only -inf, +inf and NaN; the engine's trainer-mode logprobs through them equal TRL's function,
and a rollout's logprobs are the same bits with the kernels refused. Controls: the same operations with
another exp (float64's, rounded) or another sum order, or the bf16 log without its roundings, must miss torch
somewhere, or these comparisons could not see the kernels' choices; a kernel that disagrees with torch on
its probe is refused (warned) and torch's op runs."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from workloads import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.kernels import trainer_reductions
from autobucket.engine.trainer_logprobs import trainer_logprobs

pytestmark = [pytest.mark.engine]

# tails (9, 33, 50,257), one vector (8), the cascade's levels (> 512: 4,096 and up), real vocabularies
VOCABS = (8, 9, 33, 100, 4_096, 32_000, 49_152, 50_257, 151_936)
# bf16: one 16-value vector, partial vectors of <= 8 and > 8 values, real vocabularies
BF16_VOCABS = (16, 17, 24, 25, 31, 1_000, 32_000, 50_257, 151_936)


@pytest.fixture
def fp32_kernel():
    if not trainer_reductions.fp32_available():
        pytest.skip("the kernel library or torch's MKL vector math is missing here: torch's op runs")
    return torch.ops.autobucket.trainer_logsumexp


@pytest.fixture
def bf16_kernel():
    if not trainer_reductions.bf16_available():
        pytest.skip("no AVX2 build of the library under ATen's AVX2 kernels here: torch's log_softmax runs")
    return torch.ops.autobucket.trainer_log_softmax_at


def spread_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Even rows a language model's spread (standard deviation 3), odd rows near-flat (uniform in
    [-0.7, 0]: every exp's last bit reaches the sum, and the sum's its log; the controls below check
    that an exp or an order that differs shows there)."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, vocab, generator=generator)
    logits[1::2] = -0.7 * torch.rand(logits[1::2].shape, generator=generator)
    return logits


def torch_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1, keepdim=True)


def torch_log_softmax_at(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_the_fp32_kernel_is_bitwise_torchs_logsumexp(fp32_kernel, threads):
    for vocab in VOCABS:
        for rows in (1, 3, 64):
            logits = spread_logits(rows, vocab, seed=vocab + rows)
            if rows > 1:
                logits[1, : vocab // 2] = -math.inf  # filtered tokens
            assert torch.equal(fp32_kernel(logits), torch_logsumexp(logits)), (vocab, rows, threads)


def test_the_bf16_kernel_is_bitwise_torchs_log_softmax_at_every_token(bf16_kernel, threads):
    for vocab in BF16_VOCABS:
        for rows in (1, 3, 64):
            logits = spread_logits(rows, vocab, seed=vocab + rows).bfloat16()
            if rows > 1:
                logits[1, : vocab // 2] = -math.inf
            want = torch.log_softmax(logits, dim=-1)
            for token in {0, vocab // 2 + 1, vocab - 1, *range(3, vocab, max(1, vocab // 50))}:
                tokens = torch.full((rows,), token, dtype=torch.long)
                assert torch.equal(bf16_kernel(logits, tokens), want[:, token]), (vocab, rows, token, threads)


def test_rows_without_a_finite_sum_are_torchs_too(fp32_kernel):
    logits = torch.zeros(5, 40)
    logits[0] = -math.inf  # all filtered: -inf
    logits[1, 3] = math.inf  # +inf
    logits[2, 39] = math.nan  # NaN in the vector tail
    logits[3, 0] = math.nan  # NaN in the vectors
    want, got = torch_logsumexp(logits), fp32_kernel(logits)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert got[0].item() == -math.inf and got[1].item() == math.inf and bool(got[2:4].isnan().all())


def test_bf16_rows_without_a_finite_sum_are_nan_as_torchs(bf16_kernel):
    logits = torch.zeros(4, 40, dtype=torch.bfloat16)
    logits[0] = -math.inf
    logits[1, 3] = math.inf
    logits[2, 39] = math.nan
    logits[3, 0] = math.nan
    tokens = torch.tensor([5, 3, 1, 2])
    want, got = torch_log_softmax_at(logits, tokens), bf16_kernel(logits, tokens)
    assert bool(want.isnan().all()) and bool(got.isnan().all())


def test_a_token_outside_the_vocabulary_is_refused(bf16_kernel):
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        bf16_kernel(torch.zeros(2, 32, dtype=torch.bfloat16), torch.tensor([3, 32]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_engines_trainer_logprobs_through_the_kernels_equal_trls(dtype):
    """Oracle: TRL's selective_log_softmax on a decode step's [64, 32,000] logits, T = 1 and 0.7."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    logits = spread_logits(64, 32_000, seed=3).to(dtype)
    tokens = torch.randint(0, 32_000, (64,), generator=torch.Generator().manual_seed(4))
    for temperature in (1.0, 0.7):
        ours = trainer_logprobs(logits, tokens, temperature, kernel=True)
        theirs = trl_utils.selective_log_softmax(logits[:, None], tokens[:, None], temperature=temperature)[:, 0]
        assert torch.equal(ours, theirs), temperature


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernels", ["invariant", "hf"])
def test_a_rollouts_trainer_logprobs_take_the_kernels_and_keep_their_bits(kernels, dtype, tiny_models, monkeypatch):
    """Sampled with trainer-mode logprobs, a rollout's decode steps reach the kernel of the model's dtype,
    and its tokens and logprobs are bitwise the same rollout's with the kernels refused (torch's ops)."""
    op = "trainer_logsumexp" if dtype == torch.float32 else "trainer_log_softmax_at"
    if not (trainer_reductions.fp32_available() if dtype == torch.float32 else trainer_reductions.bf16_available()):
        pytest.skip(f"{op} does not run here")
    model = copy.deepcopy(tiny_models("tiny-qwen2")).to(dtype)  # the shared fixture stays fp32
    prompts = random_prompts([5, 19, 11, 30], seed=2)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.8, seed=[1, 2, 3, 4], logprobs=True, eos_token_id=[])

    def run():  # aligned: each prompt prefilled alone, so the default kernels' tokens do not follow a plan
        # that costs learned online (by earlier tests) can move between the two runs
        config = RolloutConfig(route="aligned", kernels=kernels, persist_costs=False)
        return Rollout(model, config=config).generate(prompts, sampling)

    kernel, calls = getattr(torch.ops.autobucket, op), []
    monkeypatch.setattr(torch.ops.autobucket, op, lambda *args: calls.append(1) or kernel(*args), raising=False)
    with_kernel = run()
    assert calls, "no decode step reached the kernel"
    monkeypatch.setattr(trainer_reductions, "_takes_fp32", lambda logits: False)
    monkeypatch.setattr(trainer_reductions, "_takes_bf16", lambda *args, **kwargs: False)
    calls.clear()
    without = run()
    assert not calls and with_kernel.tokens == without.tokens and with_kernel.logprobs == without.logprobs


def test_the_widened_bf16_kernel_is_the_bf16_kernel_on_the_narrowed_logits(bf16_kernel, threads):
    """A bf16 model's decode logits as the runner holds them (widened to fp32): the same bits as the bf16
    kernel on the narrowed copy, which the selection no longer makes at temperature 1."""
    widened_kernel = torch.ops.autobucket.trainer_log_softmax_at_widened
    for vocab in BF16_VOCABS:
        for rows in (1, 3, 64):
            logits = spread_logits(rows, vocab, seed=2 * vocab + rows).bfloat16()
            if rows > 1:
                logits[1, : vocab // 2] = -math.inf
            if rows > 2:
                logits[2, vocab - 1] = math.nan
            for token in (0, vocab // 2 + 1, vocab - 1):
                tokens = torch.full((rows,), token, dtype=torch.long)
                want = bf16_kernel(logits, tokens).view(torch.int16)
                got = widened_kernel(logits.float(), tokens)
                assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want), (vocab, rows, token)
                assert torch.equal(trainer_reductions.log_softmax_at_widened(logits.float(), tokens).view(torch.int16), want)


def test_a_bf16_rollout_at_temperature_one_scores_the_widened_logits_with_the_same_bits(tiny_models, monkeypatch):
    if not trainer_reductions.bf16_available():
        pytest.skip("trainer_log_softmax_at does not run here")
    model = copy.deepcopy(tiny_models("tiny-qwen2")).to(torch.bfloat16)
    prompts = random_prompts([5, 19, 11, 30], seed=3)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=[4, 3, 2, 1], logprobs=True, eos_token_id=[])

    def run():
        config = RolloutConfig(route="aligned", kernels="invariant", persist_costs=False)
        return Rollout(model, config=config).generate(prompts, sampling)

    kernel, calls = torch.ops.autobucket.trainer_log_softmax_at_widened, []
    monkeypatch.setattr(torch.ops.autobucket, "trainer_log_softmax_at_widened",
                        lambda *args: calls.append(1) or kernel(*args), raising=False)  # fmt: skip
    widened = run()
    assert calls, "no decode step scored the widened logits"
    monkeypatch.setattr(trainer_reductions, "_takes_bf16", lambda *args, **kwargs: False)  # torch's log_softmax
    narrowed = run()
    assert widened.tokens == narrowed.tokens and widened.logprobs == narrowed.logprobs


def test_what_aten_reduces_another_way_goes_to_torchs_op(fp32_kernel, monkeypatch):
    """A lone row past ATen's grain on 2 threads (ATen may split its sum), rows under one vector, other
    dtypes and layouts: torch's op runs, and the values are torch's."""
    calls = []
    monkeypatch.setattr(torch.ops.autobucket, "trainer_logsumexp", lambda x: calls.append(x) or fp32_kernel(x), raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for logits in (spread_logits(1, 49_152, 0), spread_logits(3, 7, 0), spread_logits(8, 64, 0).double(),
                       spread_logits(64, 8, 0).t()):  # fmt: skip
            assert torch.equal(trainer_reductions.logsumexp(logits), torch_logsumexp(logits))
        assert calls == []
        torch.set_num_threads(1)
        assert torch.equal(trainer_reductions.logsumexp(lone := spread_logits(1, 49_152, 0)), torch_logsumexp(lone))
        assert len(calls) == 1  # the same row on one thread: ATen sums it whole, so the kernel takes it
    finally:
        torch.set_num_threads(before)


def test_bf16_calls_the_kernel_does_not_take_are_torchs(bf16_kernel, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.ops.autobucket, "trainer_log_softmax_at", lambda *a: calls.append(1) or bf16_kernel(*a), raising=False)
    tokens = torch.tensor([1, 2, 3])
    for logits in (spread_logits(3, 15, 0).bfloat16(), spread_logits(3, 64, 0).half(), spread_logits(64, 3, 0).bfloat16().t()):
        assert torch.equal(trainer_reductions.log_softmax_at(logits, tokens), torch_log_softmax_at(logits, tokens))
    assert calls == []


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_a_kernel_that_disagrees_with_torch_is_refused(which, monkeypatch):
    available = trainer_reductions.fp32_available if which == "fp32" else trainer_reductions.bf16_available
    if not available():
        pytest.skip(f"the {which} kernel does not run here")
    probe_name, op = ("_logsumexp_agrees", "torch.logsumexp") if which == "fp32" else ("_log_softmax_agrees", "torch.log_softmax")
    available.cache_clear()
    monkeypatch.setattr(trainer_reductions, probe_name, lambda: False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits = spread_logits(4, 1_000, 0)
            tokens = torch.tensor([0, 10, 200, 999])
            assert torch.equal(trainer_reductions.logsumexp(logits), torch_logsumexp(logits))
            bf16 = logits.bfloat16()
            assert torch.equal(trainer_reductions.log_softmax_at(bf16, tokens), torch_log_softmax_at(bf16, tokens))
        assert any(f"differs from {op}" in str(w.message) for w in caught)
        assert not available()
    finally:
        available.cache_clear()
    monkeypatch.undo()
    assert available() and getattr(trainer_reductions, probe_name)()


def test_control_another_exp_or_another_sum_order_misses_torch():
    """The same max, subtraction, log and add with float64's exp rounded to float, or with ATen's exp
    summed in float64: each must differ from torch's logsumexp on some of these near-flat rows."""
    logits = -0.7 * torch.rand(2_000, 64, generator=torch.Generator().manual_seed(5))
    want = torch_logsumexp(logits)
    maxes = logits.amax(-1, keepdim=True)
    shifted = logits - maxes
    assert torch.equal(shifted.exp().sum(-1, keepdim=True).log().add(maxes), want)  # the decomposition itself
    other_exp = shifted.double().exp().float().sum(-1, keepdim=True).log().add(maxes)
    other_order = shifted.exp().double().sum(-1, keepdim=True).float().log().add(maxes)
    assert not torch.equal(other_exp, want)
    assert not torch.equal(other_order, want)


def test_control_bf16_without_its_roundings_misses_torch():
    """torch's bf16 log_softmax at a token, against the same row's log-probability with its sum in float64,
    or its log not rounded to bf16, or fp32's log_softmax rounded once: each must differ somewhere."""
    generator = torch.Generator().manual_seed(6)
    logits = (-0.7 * torch.rand(5_000, 64, generator=generator)).bfloat16()
    tokens = torch.randint(0, 64, (5_000,), generator=generator)
    want = torch_log_softmax_at(logits, tokens)
    values = logits.float()
    shifted = values - values.amax(-1, keepdim=True)
    at = lambda rows: rows.gather(-1, tokens[:, None])[:, 0].bfloat16()  # noqa: E731
    sum_in_float64 = shifted.double().exp().sum(-1, keepdim=True).log().float().bfloat16().float()
    log_unrounded = shifted.exp().sum(-1, keepdim=True).bfloat16().float().log()
    assert not torch.equal(at(shifted - sum_in_float64), want)
    assert not torch.equal(at(shifted - log_unrounded), want)
    assert not torch.equal(torch.log_softmax(values, -1).gather(-1, tokens[:, None])[:, 0].bfloat16(), want)
