"""Sampling: the sampler against the target distribution and HF's warpers; route invariance, n samples
with one shared prefill, and logprobs against single-request HF generate."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.costs.coefficients import BENCH_QWEN2_GEOMETRY, CostCoefficients
from autobucket.engine.sampling import argmax, inverse_cdf
from autobucket.engine.sampling.inverse_cdf import UnsamplableRows, blockwise_inverse_cdf, sample_inverse_cdf
from autobucket.engine.sampling.streams import request_seed, stream_uniforms
from autobucket.engine.sampling.warpers import warp_logits
from autobucket.models import build_tiny_model
from autobucket.planning.planner import plan_prefill, shared_prefill_costs
from autobucket.planning.route_choice import choose_route

ROUTES = ("ordinary", "equal_width", "aligned", "auto")
# A high fixed cost: auto runs ordinary generation when it is eligible (all rows fit) and bucketed CB
# when it is not (more rows than continuous_batch_size); both paths are exercised below.
AUTO_COSTS = CostCoefficients(fixed_ms=50.0, token_ms=0.01, attention_ms=0.0, kv_ms=0.0, decode_ms=1.0)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("tiny-llama", seed=3)


def random_prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (length,), generator=generator).tolist() for length in lengths]


def sampling(**overrides):
    settings = dict(max_new_tokens=8, temperature=1.0, top_k=40, top_p=0.9, seed=11, logprobs=True)
    settings.update(overrides)
    return SamplingConfig(**settings)


# ---------------------------------------------------------------- the sampler itself
FIXED_LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])


def empirical_counts(scores: torch.Tensor, draws: int) -> np.ndarray:
    uniforms = torch.from_numpy(stream_uniforms([1234] * draws, [0] * draws, list(range(draws))))
    tokens, _ = sample_inverse_cdf(scores.expand(draws, -1), uniforms)
    return np.bincount(tokens.numpy(), minlength=scores.shape[-1])


def expected_counts(probabilities: np.ndarray, total: int) -> np.ndarray:
    return probabilities / probabilities.sum() * total


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.8), (0.9, 5, 0.7)]
)
def test_sampler_matches_target_distribution(temperature, top_k, top_p):
    scores = warp_logits(FIXED_LOGITS, temperature, top_k, top_p)
    target = torch.softmax(scores.double(), dim=-1)[0].numpy()
    counts = empirical_counts(scores, draws=40_000)
    assert counts[target == 0].sum() == 0, "a filtered token was sampled"
    kept = target > 0
    statistic, p_value = chisquare(counts[kept], expected_counts(target[kept], counts.sum()))
    assert p_value > 1e-3, (statistic, counts, target)


def test_chi_square_detects_a_wrong_distribution():
    """Negative control: the same test rejects samples drawn at the wrong temperature."""
    counts = empirical_counts(warp_logits(FIXED_LOGITS, 1.5, 0, 1.0), draws=40_000)
    target = torch.softmax(FIXED_LOGITS.double(), dim=-1)[0].numpy()
    assert chisquare(counts, expected_counts(target, counts.sum())).pvalue < 1e-6


def exact_inverse_cdf(scores: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: float64 softmax, its cumulative sum, the first token whose CDF exceeds the draw, and
    the CDF on both sides of every token (to tell a rounding flip at a boundary from a wrong token)."""
    cdf = torch.softmax(scores.double(), dim=-1).cumsum(dim=-1)
    draws = uniforms.double()[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, draws, right=True).clamp(max=scores.shape[1] - 1).squeeze(-1)
    return tokens, cdf


def assert_inverse_cdf(tokens: torch.Tensor, scores: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Every token is the exact inverse CDF's, or one a draw within 1e-6 of probability mass of its
    boundary moved by rounding; a filtered token is never chosen. Returns which rows are exact."""
    exact, cdf = exact_inverse_cdf(scores, uniforms)
    assert torch.isfinite(scores.gather(1, tokens[:, None])).all(), "a filtered token was sampled"
    draws = uniforms.double() * cdf[:, -1]
    rows = torch.arange(len(tokens))
    below = torch.where(tokens > 0, cdf[rows, (tokens - 1).clamp(min=0)], torch.zeros_like(draws))
    near = (draws - below).abs().minimum((cdf[rows, tokens] - draws).abs())
    differs = tokens != exact
    assert (near[differs] < 1e-6).all(), (tokens[differs], exact[differs], near[differs])
    inside = (below - 1e-6 <= draws) & (draws < cdf[rows, tokens] + 1e-6)
    assert inside.all(), "a token whose CDF interval does not hold the draw"
    return ~differs


def sampler_form(form: str):
    """The kernel library's one-sweep op (`csrc/sample_inverse_cdf.cpp`, called directly so a declined row
    shows as -1) or the torch-op form it falls back to."""
    if form == "torch":
        return blockwise_inverse_cdf
    kernel = inverse_cdf._sampler_kernel()
    if kernel is None:
        pytest.skip("the kernel library does not build here, or the CPU has neither AVX2 nor AVX-512")
    return lambda scores, uniforms: kernel(scores.float(), uniforms.double())


@pytest.mark.parametrize("form", ["kernel", "torch"])
@pytest.mark.parametrize("vocab", [7, 128, 1000, 32_000, 50_257])
def test_sampler_is_the_exact_inverse_cdf_up_to_rounding(vocab, form):
    sample_inverse_cdf = sampler_form(form)
    generator = torch.Generator().manual_seed(vocab)
    scores = torch.randn(300, vocab, generator=generator) * 4
    scores[::3, vocab // 2 :] = float("-inf")  # filtered tails, as top-k / top-p leave them
    scores[1::7, 1:] = float("-inf")  # one token left
    uniforms = torch.rand(300, dtype=torch.float64, generator=generator)
    uniforms[:20] = 1.0 - 2.0**-53  # the largest draw: lands in the last kept token's block
    uniforms[20:30] = 0.0
    tokens, logprobs = sample_inverse_cdf(scores, uniforms)
    exact = assert_inverse_cdf(tokens, scores, uniforms)
    assert exact[30:].double().mean() > 0.99  # the random draws (the largest draw sits on a boundary)
    expected = torch.log_softmax(scores.double(), dim=-1).gather(1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_inverse_cdf_check_rejects_a_shifted_sampler():
    """Negative control: the check above fails a sampler that picks the token after the right one."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(200, 1000, generator=generator) * 4
    uniforms = torch.rand(200, dtype=torch.float64, generator=generator)
    tokens, _ = sample_inverse_cdf(scores, uniforms)
    with pytest.raises(AssertionError):
        assert_inverse_cdf((tokens + 1).clamp(max=999), scores, uniforms)


@pytest.mark.parametrize("form", ["kernel", "torch"])
def test_a_rows_sample_does_not_depend_on_the_other_rows(form):
    sample_inverse_cdf = sampler_form(form)
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(64, 32_000, generator=generator) * 3
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    tokens, logprobs = sample_inverse_cdf(scores, uniforms)
    for row in (0, 17, 63):
        alone_tokens, alone_logprobs = sample_inverse_cdf(scores[row : row + 1], uniforms[row : row + 1])
        assert alone_tokens.item() == tokens[row].item()
        assert alone_logprobs.item() == logprobs[row].item()  # bitwise


def test_the_kernel_and_the_torch_form_draw_the_same_tokens():
    """Two computations of one contract: they differ only where rounding moves a boundary past a draw,
    so on random rows (and filtered tails) almost every token is equal, and every logprob is close."""
    kernel = sampler_form("kernel")
    generator = torch.Generator().manual_seed(5)
    scores = torch.randn(2000, 1000, generator=generator) * 4
    scores[::4, 700:] = float("-inf")
    uniforms = torch.rand(2000, dtype=torch.float64, generator=generator)
    kernel_tokens, kernel_logprobs = kernel(scores, uniforms)
    torch_tokens, torch_logprobs = blockwise_inverse_cdf(scores, uniforms)
    assert (kernel_tokens == torch_tokens).double().mean() > 0.999
    same = kernel_tokens == torch_tokens
    torch.testing.assert_close(kernel_logprobs[same], torch_logprobs[same], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("form", ["kernel", "torch"])
def test_rows_without_a_distribution_raise_naming_them(form):
    """A NaN or +inf score, or a row with every token filtered, defines no distribution: both forms refuse
    the call naming the rows (as torch.multinomial refuses such probabilities); the kernel answers -1 there."""
    generator = torch.Generator().manual_seed(6)
    scores = torch.randn(5, 300, generator=generator)
    uniforms = torch.rand(5, dtype=torch.float64, generator=generator)
    scores[1, 17], scores[2, 299], scores[3] = float("nan"), float("inf"), float("-inf")
    if form == "kernel":
        tokens, _ = sampler_form("kernel")(scores, uniforms)
        assert tokens.tolist()[1:4] == [-1, -1, -1] and (tokens[[0, 4]] >= 0).all()
        with pytest.raises(RuntimeError, match=r"cannot sample rows \[1, 2, 3\].*NaN or \+inf"):
            sample_inverse_cdf(scores, uniforms)
    with pytest.raises(RuntimeError, match=r"cannot sample rows \[1, 2, 3\]"):
        blockwise_inverse_cdf(scores, uniforms)
    assert sample_inverse_cdf(scores[[0, 4]], uniforms[[0, 4]])[0].shape == (2,)  # the good rows still sample


def test_temperature_one_warps_to_the_logits_values():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    assert torch.equal(warp_logits(logits, 1.0, 0, 1.0), logits / 1.0)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.8, 5, 1.0), (1.0, 0, 0.75), (1.2, 20, 0.6), (1.0, 1, 1.0)])
def test_warp_equals_hf_warpers(temperature, top_k, top_p):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5))
    logits[0, :10] = 1.0  # ties at the top-k boundary are kept by both
    hf = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        hf.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        hf.append(TopPLogitsWarper(top_p))
    expected = hf(torch.zeros(6, 1, dtype=torch.long), logits.clone())
    torch.testing.assert_close(warp_logits(logits, temperature, top_k, top_p), expected)


def test_streams_are_pure_and_distinct():
    first = stream_uniforms([1, 1, 2], [0, 1, 0], [5, 5, 5])
    np.testing.assert_array_equal(first, stream_uniforms([1, 1, 2], [0, 1, 0], [5, 5, 5]))
    assert len(set(first.tolist())) == 3 and ((first >= 0) & (first < 1)).all()
    assert request_seed(7, 0) != request_seed(7, 1) != request_seed(8, 1)


# ---------------------------------------------------------------- route invariance
def generate(model, route, prompts, settings, **config):
    return Rollout(model, config=RolloutConfig(route=route, costs=AUTO_COSTS, **config)).generate(prompts, settings)


@pytest.mark.parametrize("batch_size", [32, 3])
def test_same_seed_same_tokens_on_every_route(model, batch_size):
    prompts = random_prompts([5, 17, 3, 30, 9, 12, 1, 25])
    results = {route: generate(model, route, prompts, sampling(continuous_batch_size=batch_size)) for route in ROUTES}
    assert results["auto"].route == ("ordinary" if batch_size == 32 else "bucketed")
    for route, result in results.items():
        assert result.tokens == results["aligned"].tokens, route
        for ours, theirs in zip(result.logprobs, results["aligned"].logprobs, strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-4)
    distinct = {tuple(tokens) for tokens in results["aligned"].tokens}
    assert len(distinct) == len(prompts)


def test_tokens_do_not_depend_on_other_prompts(model):
    prompts = random_prompts([9, 4, 21, 6, 14])
    seeds = [101, 202, 303, 404, 505]
    alone = [generate(model, "aligned", [p], sampling(seed=[s])).tokens[0] for p, s in zip(prompts, seeds, strict=True)]
    for route in ROUTES:
        together = generate(model, route, prompts, sampling(seed=seeds, continuous_batch_size=2)).tokens
        assert together == alone, route
    shuffled = generate(model, "equal_width", prompts[::-1], sampling(seed=seeds[::-1])).tokens
    assert shuffled == alone[::-1]
    # a call-wide seed keys streams by prompt index: appending prompts leaves earlier ones unchanged
    short = generate(model, "aligned", prompts[:2], sampling(seed=9)).tokens
    assert generate(model, "equal_width", prompts, sampling(seed=9)).tokens[:2] == short


def test_different_seeds_give_different_samples(model):
    prompts = random_prompts([8, 8, 8])
    assert generate(model, "aligned", prompts, sampling(seed=1)).tokens != generate(
        model, "aligned", prompts, sampling(seed=2)).tokens


# ---------------------------------------------------------------- n samples, shared prefill
class _StreamSampler:
    """Oracle processor for one independent single-prompt HF generate run: draws sample `sample` of a
    request with seed `seed` from the same stream, then forces HF's greedy step to take it."""

    def __init__(self, seed, sample, width, temperature, top_k, top_p):
        self.seed, self.sample, self.width = seed, sample, width
        self.warp = (temperature, top_k, top_p)

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.width
        uniform = torch.from_numpy(stream_uniforms([self.seed], [self.sample], [step]))
        token, _ = sample_inverse_cdf(warp_logits(scores.float(), *self.warp), uniform)
        return torch.full_like(scores, float("-inf")).scatter_(1, token[:, None], 0.0)


def test_n_samples_equal_independent_single_prompt_runs(model):
    prompts = random_prompts([12, 5, 20])
    n, settings = 4, sampling(n=4, continuous_batch_size=5, seed=3)
    result = generate(model, "equal_width", prompts, settings)
    assert len(result.tokens) == 3 and all(len(samples) == n for samples in result.tokens)
    for p, prompt in enumerate(prompts):
        for s in range(n):
            processor = _StreamSampler(request_seed(3, p), s, len(prompt), 1.0, 40, 0.9)
            oracle = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=8, do_sample=False, logits_processor=LogitsProcessorList([processor]),
                pad_token_id=0, eos_token_id=None,
            )[0, len(prompt):].tolist()
            assert result.tokens[p][s] == oracle, (p, s)
    assert len({tuple(t) for t in result.tokens[0]}) == n, "samples of one prompt must differ"


@pytest.mark.parametrize("route", ["aligned", "equal_width", "auto"])
def test_shared_prefill_counts_unique_prompts(model, route):
    lengths = [7, 19, 3, 11]
    prompts = random_prompts(lengths)
    result = generate(model, route, prompts, sampling(n=8, continuous_batch_size=12))
    assert sum(len(group) for admission in result.profile.prefill_groups for g in admission for group in [g]) == 4
    if route == "aligned":
        assert result.profile.prefill_forwards == 4
        assert result.profile.prefill_tokens == sum(lengths)
    ordinary = generate(model, "ordinary", prompts, sampling(n=8, continuous_batch_size=12))
    assert ordinary.profile.prefill_tokens > result.profile.prefill_tokens
    assert result.tokens == ordinary.tokens


def test_to_padded_flattens_samples(model):
    result = generate(model, "aligned", random_prompts([4, 6]), sampling(n=3))
    responses, mask = result.to_padded(pad_id=0)
    assert responses.shape[0] == 6 and mask.sum().item() == sum(len(t) for t in result.flat_tokens())


def test_planner_costs_shared_prefill():
    lengths = [512] + [16] * 31
    costs = CostCoefficients(kv_ms=0.5)
    shared = plan_prefill(lengths, BENCH_QWEN2_GEOMETRY, costs, samples_per_prompt=8)
    scaled = plan_prefill(lengths, BENCH_QWEN2_GEOMETRY, shared_prefill_costs(costs, 8))
    assert shared == scaled and shared.cost_ms > plan_prefill(lengths, BENCH_QWEN2_GEOMETRY, costs).cost_ms
    decision = choose_route([16] * 4, 8, 32, BENCH_QWEN2_GEOMETRY, costs, samples_per_prompt=8)
    assert decision.ordinary_ms is not None  # 4 prompts x 8 samples = 32 rows fit the capacity
    blocked = choose_route([16] * 5, 8, 32, BENCH_QWEN2_GEOMETRY, costs, samples_per_prompt=8)
    assert blocked.route == "bucketed" and "40 rows exceed continuous_batch_size 32" in blocked.reason


# ---------------------------------------------------------------- logprobs
def test_greedy_logprobs_equal_hf_log_softmax(model):
    prompts = random_prompts([6, 15, 2])
    settings = SamplingConfig(max_new_tokens=6, logprobs=True)
    for route in ROUTES:
        result = generate(model, route, prompts, settings)
        for prompt, tokens, logprobs in zip(prompts, result.tokens, result.logprobs, strict=True):
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
            expected = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=False)]
            np.testing.assert_allclose(logprobs, expected, atol=1e-4)
            assert all(value <= 0 for value in logprobs) and math.isfinite(sum(logprobs))


@pytest.mark.parametrize("mode", ["processed", "trainer"])
def test_sampled_logprobs_are_under_the_warped_or_the_trainers_distribution(model, mode):
    """processed: under the top-5 distribution sampled from; trainer: the full-vocabulary log-softmax of
    logits / temperature a trainer computes (oracle: a teacher-forced forward); each differs from the other."""
    prompt = random_prompts([10])[0]
    settings = dataclasses.replace(sampling(top_k=5, top_p=1.0, max_new_tokens=4, temperature=0.7), logprobs_mode=mode)
    result = generate(model, "aligned", [prompt], settings)
    with torch.inference_mode():
        ids = torch.tensor([prompt + result.tokens[0]])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    warped = torch.log_softmax(warp_logits(logits, 0.7, 5, 1.0), -1)
    full = torch.log_softmax(logits / 0.7, -1)
    expected, other = (warped, full) if mode == "processed" else (full, warped)
    index = torch.tensor(result.tokens[0])[:, None]
    np.testing.assert_allclose(result.logprobs[0], expected.gather(-1, index).squeeze(-1).numpy(), atol=1e-4)
    assert not np.allclose(result.logprobs[0], other.gather(-1, index).squeeze(-1).numpy(), atol=1e-3)
    assert all(value > math.log(1e-9) for value in result.logprobs[0])  # never a filtered token


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("n", 0), ("seed", 1.5), ("seed", "7"),
     ("seed", [1, -2]), ("logprobs", "yes"), ("logprobs_mode", "raw"), ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")),
     ("typical_p", 0.0), ("typical_p", 1.01), ("typical_p", "0.9"), ("epsilon_cutoff", 1.0),
     ("epsilon_cutoff", -1e-4), ("eta_cutoff", 1.0), ("eta_cutoff", float("inf")), ("eta_cutoff", True)],
)
def test_bad_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r} is invalid")):
        SamplingConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [("min_p", 1.5, r"in \[0, 1\] \(0\.0 disables it\)"), ("typical_p", 0.0, r"in \(0, 1\] \(1\.0 disables it\)"),
     ("epsilon_cutoff", 1.0, r"in \[0, 1\) \(0\.0 disables it\)"), ("eta_cutoff", -0.5, r"in \[0, 1\)")],
)  # fmt: skip
def test_bad_warper_values_say_the_range_and_the_off_value(field, value, fix):
    with pytest.raises(ValueError, match=fix):
        SamplingConfig(**{field: value})


def test_warper_range_ends_and_off_values_are_accepted():
    for settings in ({"min_p": 0.0}, {"min_p": 1.0}, {"typical_p": 1.0}, {"typical_p": 1e-9}, {"epsilon_cutoff": 0.0},
                     {"epsilon_cutoff": 0.999}, {"eta_cutoff": 0.0}, {"eta_cutoff": 0.5}):  # fmt: skip
        assert getattr(SamplingConfig(temperature=1.0, **settings), next(iter(settings))) == next(iter(settings.values()))


def test_seed_list_must_match_prompts(model):
    rollout = Rollout(model, config=RolloutConfig(route="aligned"))
    with pytest.raises(ValueError, match="seed has 2 values for 3 prompts"):
        rollout.generate(random_prompts([3, 4, 5]), sampling(seed=[1, 2]))
    assert len(rollout.generate(random_prompts([3]), sampling()).tokens) == 1  # still usable


def test_greedy_selection_breaks_ties_like_argmax():
    """Greedy takes the first maximal id, as HF's argmax does; ties are planted at both ends and inside."""
    from autobucket.engine.selection import SamplerSettings, select_tokens

    logits = torch.randn(6, 4096, generator=torch.Generator().manual_seed(0))
    for row, ids in enumerate([(0, 4095), (17, 3), (2048, 2049), (5, 5), (4095, 1), (100, 99, 98)]):
        logits[row, list(ids)] = logits[row].max() + 1.0
    settings = SamplerSettings(0.0, 0, 1.0, (0,) * 6)
    tokens, _ = select_tokens(logits, settings, list(range(6)), [0] * 6, [0] * 6, False)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens.tolist()[:3] == [0, 3, 2048]


@pytest.mark.parametrize("form", ["kernel", "two_pass"])
@pytest.mark.parametrize("vocab", [32000, 32003, 4095, 5000, 17])
def test_first_argmax_is_argmax_on_planted_ties_tails_infinities_and_nan(vocab, form):
    """Oracle: torch.argmax (first maximal value). Ties inside one block and vector, across block
    boundaries, in the tail past the last whole block or vector, a row of equal values, an all -inf row,
    NaN rows (argmax answers the first NaN), +inf and a -0.0 / 0.0 tie; both forms (the kernel library's
    op and the torch-op fallback)."""
    from autobucket.engine.sampling.argmax import ARGMAX_BLOCK

    if form == "kernel" and argmax._argmax_kernel() is None:
        pytest.skip("the kernel library does not build here")
    first = argmax.first_argmax if form == "kernel" else argmax.two_pass_argmax
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(vocab))
    block = min(ARGMAX_BLOCK, vocab - 3)
    planted = [(5, 9), (block - 1, block), (3 * block + 7, block + 2), (vocab - 1, vocab - 2), (vocab - 1,)]
    for row, ids in enumerate(planted):
        logits[row, [i % vocab for i in ids]] = logits[row].max() + 1.0
    logits[5] = 0.25
    logits[6] = -torch.inf
    logits[7, [11 % vocab, vocab - 3]] = torch.nan
    logits[8, [vocab - 1, 2]] = torch.inf
    logits[9] = -1.0
    logits[9, [3, 4]] = torch.tensor([-0.0, 0.0])
    logits[10, vocab - 1] = torch.nan
    logits[11, 0] = torch.nan
    with torch.inference_mode():
        assert torch.equal(first(logits), logits.argmax(dim=-1))
    if vocab > 2 * ARGMAX_BLOCK:
        assert first(logits)[:2].tolist() == [5, block - 1]


def test_control_an_argmax_that_takes_the_last_maximal_value_fails_the_oracle():
    logits = torch.randn(3, 4000, generator=torch.Generator().manual_seed(1))
    logits[:, [7, 3000]] = 9.0
    last = logits.shape[1] - 1 - logits.flip(-1).argmax(dim=-1)
    assert not torch.equal(last, logits.argmax(dim=-1))


@pytest.mark.parametrize("kernels", ["hf", "invariant"])
def test_nan_logits_raise_naming_the_rows_and_the_rollout_stays_usable(kernels):
    """A model whose forward yields NaN logits (here one poisoned head row: every row's logit for that
    token) makes a sampled call raise, naming the rows, as torch.multinomial would; once the weights are
    repaired the same Rollout samples again, bitwise as a fresh one does."""
    from autobucket.models import build_tiny_model

    model = build_tiny_model("tiny-llama", seed=3)
    prompts = random_prompts([5, 9, 3])
    rollout = Rollout(model, config=RolloutConfig(route="aligned", kernels=kernels, persist_costs=False))
    head = model.get_output_embeddings().weight
    saved = head[7].clone()
    with torch.no_grad():
        head[7] = float("nan")
    with pytest.raises(RuntimeError, match=r"cannot sample prompt \d \(sample 0, new token 0\) of this step.*NaN") as raised:
        rollout.generate(prompts, sampling())  # aligned: one prompt's row a step
    assert isinstance(raised.value, UnsamplableRows) and raised.value.rows == [0]
    with torch.no_grad():
        head[7] = saved
    repaired = rollout.generate(prompts, sampling())
    fresh = Rollout(model, config=RolloutConfig(route="aligned", kernels=kernels, persist_costs=False))
    expected = fresh.generate(prompts, sampling())
    assert repaired.tokens == expected.tokens and repaired.logprobs == expected.logprobs
