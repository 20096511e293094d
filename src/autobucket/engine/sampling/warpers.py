"""HF's sampling warpers on [rows, vocab] logits, in HF's order (`GenerationMixin._get_logits_processor`).

Temperature, top-k (ties at the k-th logit kept), top-p (smallest set whose probability exceeds top_p),
min-p, typical, epsilon, eta; each keeps at least one token, and each works on the scores the previous
one left (so e.g. the epsilon cutoff compares against the top-k survivors' renormalised probabilities).
tests/engine/sampling/test_sampling_warpers.py checks each against HF's own warper."""

from __future__ import annotations

import torch


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
