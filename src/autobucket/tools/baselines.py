"""Baselines the benchmarks compare against: transformers' own continuous batching (5.x only)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from autobucket.engine.ordinary import cut_at_eos


def has_generate_batch(model: torch.nn.Module) -> bool:
    return hasattr(model, "generate_batch")


@torch.inference_mode()
def hf_generate_batch(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_ids: Sequence[int] = ()
) -> list[list[int]]:
    """Greedy `model.generate_batch`, sized for a small CPU machine (its defaults reserve ~10 GB).

    ENVIRONMENT.md: num_blocks=128, page_size=64, max_batch_tokens=1024 take ~1 GB; about 0.55 s of
    each call is stopping its manager, which is part of what a caller pays.
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.max_new_tokens = False, max_new_tokens
    config.eos_token_id = list(eos_token_ids) or None
    sizing = ContinuousBatchingConfig(num_blocks=128, page_size=64, max_batch_tokens=1024, use_cuda_graph=False)
    outputs = model.generate_batch(
        inputs=[list(p) for p in prompts], generation_config=config, continuous_batching_config=sizing
    )
    ordered = sorted(outputs.values(), key=lambda out: int(str(out.request_id).rsplit("_", 1)[-1]))
    eos = frozenset(eos_token_ids)
    return [cut_at_eos(list(out.generated_tokens), eos, max_new_tokens)[0] for out in ordered]
