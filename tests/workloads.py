"""The workloads tests share: the oracle suite's architectures and routes, random prompts over the tiny
models' vocabulary, EOS ids that fire for some prompts only, and a trainer's steering hook."""

from __future__ import annotations

import random
from collections.abc import Sequence

ARCHS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-opt", "tiny-gpt2")
ROUTES = ("ordinary", "equal_width", "aligned")
CB_ROUTES = ("equal_width", "aligned")
VOCAB = 1024


def random_prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Prompts of the given lengths with token ids drawn from [3, vocab) (0-2 are pad/bos/eos ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for length in lengths]



def steering_hook(model):
    """A trainer's forward hook that changes a decoder layer's output (activation steering: a fixed vector
    added), so every later layer's K/V changes while no parameter does."""
    import torch

    steer = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 2

    def hook(module, args, output):
        return (output[0] + steer, *output[1:]) if isinstance(output, tuple) else output + steer

    return hook


def firing_eos_candidates(oracle_tokens: list[list[int]]) -> list[int]:
    """EOS ids that greedy decoding emits at step >= 2 for some prompts and never for others.

    Ordered by how many prompts first emit the token at step >= 2 (then by id), among tokens that do
    not occur at all in at least one prompt's output (so some rows still end by length).
    """
    counts: dict[int, int] = {}
    for tokens in oracle_tokens:
        seen: set[int] = set()
        for step, token in enumerate(tokens):
            if token not in seen and step >= 2:
                counts[token] = counts.get(token, 0) + 1
            seen.add(token)
    absent_somewhere = {t for t in counts if any(t not in tokens for tokens in oracle_tokens)}
    return sorted(absent_somewhere, key=lambda t: (-counts[t], t))


def choose_firing_eos(oracle_tokens: list[list[int]]) -> int:
    candidates = firing_eos_candidates(oracle_tokens)
    assert candidates, "no token fires as EOS for some prompts but not all: change the workload"
    return candidates[0]


def cut_length(tokens: list[int], eos: int) -> int:
    """How many tokens a row keeps when `eos` ends it."""
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)



WAIT_S = 120  # the most any one asynchronous request may take on a busy machine


def sampled(budget: int, seed: int):
    """Sampling settings for the asynchronous engine's tests: EOS off, temperature 1, top-k 50, logprobs."""
    from autobucket.config import SamplingConfig

    return SamplingConfig(max_new_tokens=budget, eos_token_id=[], temperature=1.0, top_k=50, seed=seed, logprobs=True)


def wait_for_tokens(handle, count: int) -> None:
    """Block until `handle` has made `count` tokens (or finished)."""
    for _ in handle.stream(timeout=WAIT_S):
        if len(handle.snapshot().tokens) >= count:
            return
