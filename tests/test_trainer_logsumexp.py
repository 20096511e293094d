"""The trainer's fp32 logsumexp as one kernel op (`engine/kernels/trainer_logsumexp.py`) against its
oracle, torch's own `logsumexp` (what TRL's `selective_log_softmax` calls): bitwise on vocabularies with and
without vector tails, past ATen's cascade levels, Qwen2.5's and Gemma's vocabularies, 1, 3 and 64 rows, 1
and 2 threads, rows with some, all or only -inf, +inf and NaN; and the engine's trainer-mode logprobs
through it equal TRL's function. Controls: the same operations with another exp (float64's, rounded) or
another sum order must miss torch somewhere, or these comparisons could not see the kernel's choices; a
kernel that disagrees with torch on the probe is refused (warned) and torch's op runs."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import random_prompts

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.engine.kernels import trainer_logsumexp
from autobucket.engine.trainer_logprobs import trainer_logprobs

pytestmark = [pytest.mark.engine]

# tails (9, 33, 50,257), one vector (8), the cascade's levels (> 512: 4,096 and up), real vocabularies
VOCABS = (8, 9, 33, 100, 4_096, 32_000, 49_152, 50_257, 151_936)


@pytest.fixture
def kernel():
    if not trainer_logsumexp.available():
        pytest.skip("the kernel library or torch's MKL vector math is missing here: torch's op runs")
    return torch.ops.autobucket.trainer_logsumexp


def spread_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Even rows a language model's spread (standard deviation 3), odd rows near-flat (uniform in
    [-0.7, 0]: every exp's last bit reaches the sum, and the sum's its log; the control below checks
    that an exp or an order that differs shows there)."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, vocab, generator=generator)
    logits[1::2] = -0.7 * torch.rand(logits[1::2].shape, generator=generator)
    return logits


def torch_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1, keepdim=True)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_is_bitwise_torchs_logsumexp(kernel, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for vocab in VOCABS:
            for rows in (1, 3, 64):
                logits = spread_logits(rows, vocab, seed=vocab + rows)
                if rows > 1:
                    logits[1, : vocab // 2] = -math.inf  # filtered tokens
                assert torch.equal(kernel(logits), torch_logsumexp(logits)), (vocab, rows, threads)
    finally:
        torch.set_num_threads(before)


def test_rows_without_a_finite_sum_are_torchs_too(kernel):
    logits = torch.zeros(5, 40)
    logits[0] = -math.inf  # all filtered: -inf
    logits[1, 3] = math.inf  # +inf
    logits[2, 39] = math.nan  # NaN in the vector tail
    logits[3, 0] = math.nan  # NaN in the vectors
    want = torch_logsumexp(logits)
    got = kernel(logits)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert got[0].item() == -math.inf and got[1].item() == math.inf and bool(got[2:4].isnan().all())


def test_the_engines_trainer_logprobs_through_the_kernel_equal_trls(kernel):
    """Oracle: TRL's selective_log_softmax on a decode step's [64, 32,000] logits, T = 1 and 0.7."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    logits = spread_logits(64, 32_000, seed=3)
    tokens = torch.randint(0, 32_000, (64,), generator=torch.Generator().manual_seed(4))
    for temperature in (1.0, 0.7):
        ours = trainer_logprobs(logits, tokens, temperature, kernel=True)
        theirs = trl_utils.selective_log_softmax(logits[:, None], tokens[:, None], temperature=temperature)[:, 0]
        assert torch.equal(ours, theirs), temperature


@pytest.mark.parametrize("kernels", ["invariant", "hf"])
def test_a_rollouts_trainer_logprobs_take_the_kernel_and_keep_their_bits(kernel, kernels, tiny_models, monkeypatch):
    """Sampled with trainer-mode logprobs, a rollout's decode steps reach the kernel, and its tokens and
    logprobs are bitwise the same rollout's with the kernel refused (torch's logsumexp)."""
    model = tiny_models("tiny-qwen2")
    prompts = random_prompts([5, 19, 11, 30], seed=2)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.8, seed=[1, 2, 3, 4], logprobs=True, eos_token_id=[])

    def run():
        return Rollout(model, config=RolloutConfig(kernels=kernels, persist_costs=False)).generate(prompts, sampling)

    calls = []
    monkeypatch.setattr(torch.ops.autobucket, "trainer_logsumexp", lambda x: calls.append(x.shape) or kernel(x), raising=False)
    with_kernel = run()
    assert calls, "no decode step reached the kernel"
    monkeypatch.setattr(trainer_logsumexp, "_takes", lambda logits: False)
    without = run()
    assert with_kernel.tokens == without.tokens and with_kernel.logprobs == without.logprobs


def test_what_aten_reduces_another_way_goes_to_torchs_op(kernel, monkeypatch):
    """A lone row past ATen's grain on 2 threads (ATen may split its sum), rows under one vector, other
    dtypes and layouts: torch's op runs, and the values are torch's."""
    calls = []
    monkeypatch.setattr(torch.ops.autobucket, "trainer_logsumexp", lambda x: calls.append(x) or kernel(x), raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for logits in (spread_logits(1, 49_152, 0), spread_logits(3, 7, 0), spread_logits(8, 64, 0).double(),
                       spread_logits(64, 8, 0).t()):  # fmt: skip
            assert torch.equal(trainer_logsumexp.logsumexp(logits), torch_logsumexp(logits))
        assert calls == []
        torch.set_num_threads(1)
        assert torch.equal(trainer_logsumexp.logsumexp(lone := spread_logits(1, 49_152, 0)), torch_logsumexp(lone))
        assert len(calls) == 1  # the same row on one thread: ATen sums it whole, so the kernel takes it
    finally:
        torch.set_num_threads(before)


def test_a_kernel_that_disagrees_with_torch_is_refused(kernel, monkeypatch):
    trainer_logsumexp.available.cache_clear()
    monkeypatch.setattr(trainer_logsumexp, "_agrees_with_torch", lambda: False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits = spread_logits(4, 1_000, 0)
            assert torch.equal(trainer_logsumexp.logsumexp(logits), torch_logsumexp(logits))
        assert any("differs from torch.logsumexp" in str(w.message) for w in caught)
    finally:
        trainer_logsumexp.available.cache_clear()
    monkeypatch.undo()
    assert trainer_logsumexp.available() and trainer_logsumexp._agrees_with_torch()


def test_control_another_exp_or_another_sum_order_misses_torch():
    """The same max, subtraction, log and add with float64's exp rounded to float, or with ATen's exp
    summed in float64: each must differ from torch's op on some of these near-flat rows."""
    logits = -0.7 * torch.rand(2_000, 64, generator=torch.Generator().manual_seed(5))
    want = torch_logsumexp(logits)
    maxes = logits.amax(-1, keepdim=True)
    shifted = logits - maxes
    assert torch.equal(shifted.exp().sum(-1, keepdim=True).log().add(maxes), want)  # the decomposition itself
    other_exp = shifted.double().exp().float().sum(-1, keepdim=True).log().add(maxes)
    other_order = shifted.exp().double().sum(-1, keepdim=True).float().log().add(maxes)
    assert not torch.equal(other_exp, want)
    assert not torch.equal(other_order, want)
