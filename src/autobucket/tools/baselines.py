"""Baselines the benchmarks compare against: transformers' own continuous batching (5.x only)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from autobucket.engine.finished import cut_finished
from autobucket.engine.generation_setup import eos_token_ids as as_eos_ids
from autobucket.profile import PeakMemory, reset_peak_memory

HF_BATCH = "hf_generate_batch"
DISABLED_EOS = -1  # what generate_batch itself substitutes for "no EOS" (after warning that none is set)


def has_generate_batch(model: torch.nn.Module) -> bool:
    return hasattr(model, "generate_batch")


@torch.inference_mode()
def hf_generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """Greedy `model.generate_batch`, sized for a small CPU machine (its default cache reservation is
    several times what num_blocks=128, page_size=64, max_batch_tokens=1024 take).

    `eos_token_ids`: None uses the model's generation config, as `Rollout` does; () generates to the
    budget. Each call also pays for stopping its manager, which is part of what a caller pays.
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    eos = as_eos_ids(model.generation_config.eos_token_id if eos_token_ids is None else eos_token_ids)
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.max_new_tokens = False, max_new_tokens
    # Never None: generate_batch would warn on every call that it is "not set" and use -1 itself.
    config.eos_token_id = list(eos) or DISABLED_EOS
    sizing = ContinuousBatchingConfig(num_blocks=128, page_size=64, max_batch_tokens=1024, use_cuda_graph=False)
    outputs = model.generate_batch(
        inputs=[list(p) for p in prompts], generation_config=config, continuous_batching_config=sizing
    )
    ordered = sorted(outputs.values(), key=lambda out: int(str(out.request_id).rsplit("_", 1)[-1]))
    return [cut_finished(list(out.generated_tokens), frozenset(eos), max_new_tokens)[0] for out in ordered]


def hf_batch_contender(model: torch.nn.Module, max_new_tokens: int) -> Any:
    """`hf_generate_batch` as a `tools.workloads.Contender`: prompts -> (tokens, {"peak_memory_bytes"})."""

    def run(prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, Any]]:
        device = next(model.parameters()).device
        reset_peak_memory(device)  # a benchmark owns its process: this run's peak
        with PeakMemory(device) as memory:
            tokens = hf_generate_batch(model, prompts, max_new_tokens)
        return tokens, {"peak_memory_bytes": memory.peak_bytes()}

    return run
