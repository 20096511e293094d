"""Token selection for every route: repetition penalty, then greedy or route-invariant sampling.

Why not torch's generator: HF `generate` draws every row's sample from one global generator, so a
row's tokens depend on how many rows were drawn before it — on batch composition, route and refill
order. Here each draw uses one uniform number `u = stream(seed, prompt, sample, step)`, a pure hash
of the request's identity and the step, and picks the token by inverse CDF over the warped
distribution. The same request gets the same `u` on every route, and a tiny logit difference
between routes can only change the token if `u` falls within that difference of a CDF boundary.

Warping follows HF's sampling processors in HF's order (`GenerationMixin._get_logits_processor`):
temperature, top-k (ties at the k-th logit kept), top-p (smallest set whose probability exceeds
top_p), min-p, typical, epsilon, eta; each keeps at least one token, and each works on the scores the
previous one left (so e.g. the epsilon cutoff compares against the top-k survivors' renormalised
probabilities).

The repetition penalty follows HF's `RepetitionPenaltyLogitsProcessor` exactly (negative logits
multiplied, positive divided, in fp32), but over a `seen` mask `[rows, vocab]` of the prompt's and
generated tokens, never of padding: a row's history does not depend on who it was batched with."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from autobucket.engine.trainer_logprobs import trainer_logprobs

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


def stream_uniforms(seeds: Sequence[int], samples: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    """One uniform in [0, 1) per row, a pure function of (seed, sample index, step).

    `seeds` is each row's request seed: the call's seed mixed with the prompt index, or a per-prompt
    seed the caller chose (which keeps a prompt's samples independent of its position in the batch).
    """
    with np.errstate(over="ignore"):
        # Each key is finalised on its own before it is combined: combining raw keys first
        # (e.g. (seed + c) ^ sample) makes distinct (seed, sample) pairs collide.
        state = _splitmix64(np.asarray(seeds, dtype=np.uint64) + _GOLDEN_GAMMA)
        for lane, counter in enumerate((samples, steps), start=2):
            key = _splitmix64(np.asarray(counter, dtype=np.uint64) + _GOLDEN_GAMMA * np.uint64(lane))
            state = _splitmix64(state + key)
    return (state >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def request_seed(call_seed: int, prompt_index: int) -> int:
    """The stream key of prompt `prompt_index` under one call-wide seed."""
    with np.errstate(over="ignore"):
        seed = _splitmix64(np.asarray([call_seed], dtype=np.uint64) + _GOLDEN_GAMMA)
        index = _splitmix64(np.asarray([prompt_index], dtype=np.uint64) + _GOLDEN_GAMMA * np.uint64(5))
        mixed = _splitmix64(seed + index)
    return int(mixed[0])


def request_seeds(seed: int | Sequence[int], prompt_count: int) -> tuple[int, ...]:
    """Every prompt's stream key for one call: a per-prompt list as given, or derived from one int
    and each prompt's *input* index (a wrapper that reorders or shards prompts must pass these on)."""
    if isinstance(seed, (list, tuple)):
        if len(seed) != prompt_count:
            raise ValueError(f"seed has {len(seed)} values for {prompt_count} prompts: pass one per prompt or one int")
        return tuple(seed)
    return tuple(request_seed(seed, index) for index in range(prompt_count))


def warp_logits(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    *,
    min_p: float = 0.0,
    typical_p: float = 1.0,
    epsilon_cutoff: float = 0.0,
    eta_cutoff: float = 0.0,
) -> torch.Tensor:
    """[rows, vocab] fp32 logits -> temperature-scaled logits with filtered tokens at -inf.

    Each warper runs only when set (top_k 0, top_p 1.0, min_p 0.0, typical_p 1.0 and the cutoffs 0.0
    are off), in HF's order."""
    scores = logits / temperature if temperature != 1.0 else logits  # x / 1 is x: skip a [rows, vocab] copy
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        scores = _top_p(scores, top_p)
    if min_p > 0.0:
        scores = _min_p(scores, min_p)
    if typical_p < 1.0:
        scores = _typical(scores, typical_p)
    if epsilon_cutoff > 0.0:
        scores = _below_or_top(scores, torch.tensor(epsilon_cutoff, dtype=scores.dtype, device=scores.device))
    if eta_cutoff > 0.0:
        scores = _below_or_top(scores, _eta_threshold(scores, eta_cutoff))
    return scores


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """HF's TopPLogitsWarper: drop the ascending prefix whose mass is <= 1 - top_p, keep the top token."""
    ascending, order = torch.sort(scores, dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= 1 - top_p
    drop_sorted[..., -1] = False  # keep at least the most likely token
    return scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """HF's MinPLogitsWarper: drop tokens with probability < min_p x the top probability."""
    probs = scores.softmax(dim=-1)  # [rows, vocab]
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)  # keep at least the most likely token
    return scores.masked_fill(drop, float("-inf"))


def _typical(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """HF's TypicalLogitsWarper: keep the tokens whose surprisal is closest to the entropy, up to `mass`.

    Tokens are ranked by |-log p - H|; the cut is at the first rank whose cumulative probability reaches
    `mass` (that token included, and every token tied with its distance); the most typical is always kept."""
    log_probs = scores.log_softmax(dim=-1)
    entropy = -(log_probs * log_probs.exp()).nansum(-1, keepdim=True)  # [rows, 1]; -inf * 0 = nan skipped
    distance, order = torch.sort((-log_probs - entropy).abs(), dim=-1)  # [rows, vocab] ascending
    cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=-1, keepdim=True).clamp_(max=scores.shape[-1] - 1)  # [rows, 1]
    drop_sorted = distance > distance.gather(-1, last)
    drop_sorted[..., 0] = False
    return scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def _eta_threshold(scores: torch.Tensor, eta: float) -> torch.Tensor:
    """[rows, 1] HF's EtaLogitsWarper threshold min(eta, sqrt(eta) * exp(-H)), H the entropy of softmax(scores).

    H as `torch.distributions.Categorical(logits=scores).entropy()` computes it (filtered tokens' -inf
    log-probabilities clamped to the dtype's minimum, so 0 * log 0 counts as 0)."""
    log_probs = scores - scores.logsumexp(dim=-1, keepdim=True)
    clamped = log_probs.clamp(min=torch.finfo(scores.dtype).min)
    entropy = -(clamped * log_probs.softmax(dim=-1)).sum(-1)  # [rows]
    epsilon = torch.tensor(eta, dtype=scores.dtype, device=scores.device)
    return torch.minimum(epsilon, epsilon.sqrt() * torch.exp(-entropy))[..., None]


def _below_or_top(scores: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """HF's Epsilon/Eta rule: drop tokens with probability < threshold, except those tied with the top logit."""
    drop = (scores.softmax(dim=-1) < threshold) & (scores < scores.amax(dim=-1, keepdim=True))
    return scores.masked_fill(drop, float("-inf"))


SAMPLE_BLOCK = 128  # vocabulary entries per block of `sample_inverse_cdf`'s first pass (divides 32,000,
# 49,152 and 151,936; any other vocabulary gets a shorter last block)


def sample_inverse_cdf(scores: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [rows] and their log-probabilities [rows] under softmax(scores).

    scores: [rows, vocab] warped logits; uniforms: [rows] in [0, 1). The token is the first whose
    cumulative probability (softmax in fp32) exceeds the draw u x total; filtered tokens (-inf) weigh 0
    and are never chosen, and the draw is kept strictly below the total. A row holding NaN or +inf, or
    with every token filtered, defines no distribution: RuntimeError naming it.

    Why in blocks: torch's `cumsum` over a row is one sequential loop (2.0 ms for [64, 32000], one
    thread, AMD EPYC Zen 4). So the cumulative probability runs over `SAMPLE_BLOCK`-entry block sums
    (vectorized), and only the block the draw lands in is scanned entry by entry. CPUs with AVX2 or
    AVX-512 run that as one op (`csrc/sample_inverse_cdf.cpp`: two sweeps over a row, nothing written
    but the answer; `benchmarks/sampler.py` has its times), elsewhere `blockwise_inverse_cdf` in torch
    ops (0.51-0.73x the full-row form's time). Every value is a function of the row alone (the same on
    every route and batch); rounding moves token boundaries by ~1e-7 of probability mass against the
    exact CDF, differently in the two forms.
    """
    kernel = _sampler_kernel()
    if kernel is None or scores.device.type != "cpu":
        return blockwise_inverse_cdf(scores, uniforms)
    tokens, logprobs = kernel(scores.float(), uniforms.double())
    declined = tokens < 0  # [rows]: the kernel's answer for a row holding NaN or +inf, or all -inf
    if bool(declined.any()):
        raise _unsamplable(declined)
    return tokens, logprobs


class UnsamplableRows(RuntimeError):
    """A step's rows whose scores define no distribution (NaN or +inf, or every token filtered to -inf), as
    torch.multinomial refuses them. `rows` are the step's row indices; `where` names them for the caller
    (`select_tokens`: by prompt, sample and token), else they are named as rows."""

    def __init__(self, rows: list[int], where: list[str] | None = None) -> None:
        self.rows = rows
        named = where if where is not None else [f"rows {rows[:8]}{' ...' if len(rows) > 8 else ''}"]
        shown = ", ".join(named[:8]) + (" ..." if where is not None and len(named) > 8 else "")
        super().__init__(
            f"cannot sample {shown} of this step: their logits hold NaN or +inf, or every token was filtered "
            "to -inf. The model's forward produced them: check its weights and inputs (an fp16 overflow, a "
            "diverged update)"
        )


def _unsamplable(rows: torch.Tensor) -> UnsamplableRows:
    """The error for rows [rows] bool whose scores define no distribution."""
    return UnsamplableRows(rows.nonzero().flatten().tolist())


def _sampler_kernel() -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """The kernel library's one-sweep sampler (`csrc/sample_inverse_cdf.cpp`), built where the CPU has
    AVX2 or AVX-512; elsewhere `blockwise_inverse_cdf`."""
    return _vector_op("sample_inverse_cdf")


@functools.cache
def _vector_op(name: str) -> Callable | None:
    """`torch.ops.autobucket.<name>` where the kernel library builds with a vector form (AVX-512 or AVX2),
    else None: the selection ops' scalar loops are slower than their torch-op fallbacks (first_argmax on
    AMD EPYC Zen 3, [32, 32000], interleaved: 0.96 against 0.42 ms; the AVX2 form 0.14), and the sampler
    registers only its vector form."""
    from autobucket.engine.kernels.invariant_attention import kernel_library_builds

    if not kernel_library_builds() or torch.ops.autobucket.vector_bits() < 256:
        return None
    return getattr(torch.ops.autobucket, name)


def blockwise_inverse_cdf(scores: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_inverse_cdf` in torch ops, where the kernel is not built."""
    vocab = scores.shape[1]
    weights = torch.softmax(scores.float(), dim=-1)  # [rows, vocab]: one fused pass (aten's exp is 2x slower)
    block_sums = _block_sums(weights)  # [rows, blocks]
    cumulative = block_sums.cumsum(dim=-1)
    total = cumulative[:, -1:]  # [rows, 1]
    defined = torch.isfinite(total) & (total > 0)  # softmax of a row with NaN / +inf / only -inf is NaN
    if not bool(defined.all()):
        raise _unsamplable(~defined.squeeze(-1))
    draws = torch.minimum(uniforms.to(total)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # the first block whose cumulative weight exceeds the draw (always one: draw < total)
    block = torch.searchsorted(cumulative, draws, right=True).clamp_(max=cumulative.shape[1] - 1)  # [rows, 1]
    before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp_(min=0)), torch.zeros_like(draws))
    columns = block * SAMPLE_BLOCK + torch.arange(SAMPLE_BLOCK, device=scores.device)  # [rows, SAMPLE_BLOCK]
    inside = weights.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(columns >= vocab, 0.0)
    running = before + inside.cumsum(dim=-1)  # non-decreasing: the CDF inside the block
    offset = torch.searchsorted(running, draws, right=True)  # [rows, 1]
    # Rounding can leave the block's last running value at or below a draw its block sum passed: then
    # the block's last token of non-zero weight is the one (no filtered token is ever chosen).
    last_kept = SAMPLE_BLOCK - 1 - (inside > 0).flip(-1).byte().argmax(dim=-1, keepdim=True)
    offset = torch.where(offset >= SAMPLE_BLOCK, last_kept, offset)
    tokens = (block * SAMPLE_BLOCK + offset).squeeze(-1)
    logprobs = (weights.gather(1, tokens[:, None]) / total).log().squeeze(-1)
    return tokens, logprobs


def _block_sums(weights: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows, ceil(vocab / SAMPLE_BLOCK)]: each block's sum, the last block shorter."""
    rows, vocab = weights.shape
    whole = vocab // SAMPLE_BLOCK * SAMPLE_BLOCK
    sums = weights[:, :whole].reshape(rows, -1, SAMPLE_BLOCK).sum(dim=-1)
    if whole < vocab:
        sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    return sums


@dataclass(frozen=True)
class SamplerSettings:
    temperature: float  # 0: greedy
    top_k: int  # 0: off
    top_p: float  # 1.0: off
    request_seeds: tuple[int, ...]  # per prompt: the key of its random streams
    min_p: float = 0.0  # 0.0: off
    typical_p: float = 1.0  # 1.0: off
    epsilon_cutoff: float = 0.0  # 0.0: off
    eta_cutoff: float = 0.0  # 0.0: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] fp32 logits -> the warped scores sampled from (every route calls this)."""
        return warp_logits(
            logits, self.temperature, self.top_k, self.top_p, min_p=self.min_p, typical_p=self.typical_p,
            epsilon_cutoff=self.epsilon_cutoff, eta_cutoff=self.eta_cutoff,
        )  # fmt: skip


ARGMAX_BLOCK = 1024  # vocabulary entries per block of `first_argmax`'s first pass


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows] int64: `argmax`'s answer (the first maximal value on ties; the first NaN
    in a row that has one). torch's index-tracking reductions do not vectorize on a CPU (`[32, 32000]`
    fp32, one thread: `argmax` 1.3-1.8 ms, `max(-1).indices` 1.1 ms, `amax` 0.15 ms). fp32 CPU logits take
    the kernel library's one-sweep op (`csrc/first_argmax.cpp`: 0.17 ms there, Intel Xeon; 0.14 ms, AMD EPYC
    Zen 3), where it builds with AVX-512 or AVX2."""
    kernel = _argmax_kernel()
    if kernel is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[-1] > 0:
        return kernel(logits)
    return two_pass_argmax(logits)


def _argmax_kernel() -> Callable[[torch.Tensor], torch.Tensor] | None:
    return _vector_op("first_argmax")


def two_pass_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`first_argmax` in torch ops, where the kernel library does not build (0.36 ms at `[32, 32000]`):
    pass one, each block's maximum (`amax`); pass two, `max` over the first block that holds the row's
    maximum only. A row with NaN keeps `max`'s answer (the first NaN, as `argmax` gives)."""
    rows, vocab = logits.shape
    if vocab < 4 * ARGMAX_BLOCK or logits.device.type != "cpu":
        return logits.max(dim=-1).indices
    whole = vocab // ARGMAX_BLOCK * ARGMAX_BLOCK
    block_max = logits[:, :whole].reshape(rows, -1, ARGMAX_BLOCK).amax(-1)  # [rows, blocks]
    if whole < vocab:
        block_max = torch.cat([block_max, logits[:, whole:].amax(-1, keepdim=True)], dim=1)
    row_max = block_max.amax(-1, keepdim=True)  # [rows, 1]
    if bool(row_max.isnan().any()):
        return logits.max(dim=-1).indices
    first_block = (block_max == row_max).byte().argmax(-1)  # [rows]: argmax takes the first on ties
    start = first_block * ARGMAX_BLOCK
    columns = (start[:, None] + torch.arange(ARGMAX_BLOCK, device=logits.device)).clamp_(max=vocab - 1)
    return start + logits.gather(1, columns).max(dim=-1).indices  # clamped repeats come after the real ones


def select_tokens(
    logits: torch.Tensor,
    settings: SamplerSettings,
    prompts: Sequence[int],
    samples: Sequence[int],
    steps: Sequence[int],
    want_logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[rows, vocab] fp32 logits (penalty already applied) -> tokens [rows], logprobs [rows] or None.

    Greedy logprobs are the log-softmax of the (penalised) logits at the argmax; sampled logprobs are
    under the warped distribution actually sampled from, as RL importance ratios need.
    """
    if settings.greedy:
        tokens = first_argmax(logits)
        if not want_logprobs:
            return tokens, None
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    seeds = [settings.request_seeds[p] for p in prompts]
    uniforms = torch.from_numpy(stream_uniforms(seeds, samples, steps)).to(logits.device)
    try:
        tokens, logprobs = sample_inverse_cdf(settings.warp(logits), uniforms)
    except UnsamplableRows as error:  # named for the caller: which prompt, sample and new token
        where = [f"prompt {prompts[row]} (sample {samples[row]}, new token {steps[row]})" for row in error.rows]
        raise UnsamplableRows(error.rows, where) from error
    return tokens, (logprobs if want_logprobs else None)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [rows, vocab] fp32, seen [rows, vocab] bool -> penalised logits [rows, vocab]."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def seen_tokens(prompts: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] bool: which token ids occur in each prompt."""
    seen = torch.zeros((len(prompts), vocab_size), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        seen[row, torch.as_tensor(prompt, dtype=torch.long)] = True
    return seen.to(device)


def seen_in_left_padded(input_ids: torch.Tensor, pad_lengths: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] bool: ids occurring in each row's real tokens of a left-padded `[rows, width]` batch."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    rows, columns = torch.nonzero(positions[None, :] >= pad_lengths[:, None], as_tuple=True)
    seen = torch.zeros((input_ids.shape[0], vocab_size), dtype=torch.bool, device=input_ids.device)
    seen[rows, input_ids[rows, columns]] = True
    return seen


@dataclass(frozen=True)
class Selection:
    """How every route turns one step's logits into tokens for one call."""

    sampler: SamplerSettings
    repetition_penalty: float
    want_logprobs: bool
    logprobs_mode: str = "trainer"  # SamplingConfig.logprobs_mode
    logits_dtype: torch.dtype = torch.float32  # the model's dtype: trainer logprobs are computed in it

    @property
    def uses_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    def choose(
        self,
        logits: torch.Tensor,
        seen: torch.Tensor | None,
        prompts: Sequence[int],
        samples: Sequence[int],
        steps: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [rows, vocab] fp32, seen [rows, vocab] bool | None -> (tokens [rows], logprobs [rows] | None)."""
        raw = logits
        if seen is not None and self.uses_penalty:
            logits = apply_repetition_penalty(logits, seen, self.repetition_penalty)
        processed = self.want_logprobs and self.logprobs_mode == "processed"
        tokens, logprobs = select_tokens(logits, self.sampler, prompts, samples, steps, processed)
        if self.want_logprobs and not processed:
            # The model's own logits (fp32 copies of its dtype's values, so the cast back is exact).
            temperature = 1.0 if self.sampler.greedy else self.sampler.temperature
            logprobs = trainer_logprobs(raw.to(self.logits_dtype), tokens, temperature, kernel=True).float()
        return tokens, logprobs
