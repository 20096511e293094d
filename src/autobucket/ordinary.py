"""The ordinary route: HF `generate` on left-padded batches of at most `continuous_batch_size` rows.

Outputs are cut at each row's first EOS (inclusive): what HF writes after it is structural padding.
A forward hook times the first forward of each `generate` call as prefill and the rest as decode,
so the profile has the same breakdown as the CB routes."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch
from transformers import LogitsProcessorList

from autobucket.continuous import Finished
from autobucket.generation_setup import ResolvedGeneration
from autobucket.logits import PaddingAwareRepetitionPenalty
from autobucket.prefill import left_pad
from autobucket.profile import PhaseTimer, Profile


class _ForwardClock:
    """Forward hooks that split one generate call's forwards into prefill (first) and decode."""

    def __init__(self, model: torch.nn.Module, profile: Profile, timer: PhaseTimer) -> None:
        self.profile, self.timer, self.calls, self.started = profile, timer, 0, 0.0
        self.handles = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after),
        ]

    def _before(self, *args: object) -> None:
        self.timer.sync()
        self.started = time.perf_counter()

    def _after(self, *args: object) -> None:
        self.timer.sync()
        elapsed_ms = (time.perf_counter() - self.started) * 1e3
        if self.calls == 0:
            self.profile.prefill_ms += elapsed_ms
            self.profile.prefill_forwards += 1
        else:
            self.profile.decode_ms += elapsed_ms
            self.profile.decode_forwards += 1
        self.calls += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def cut_at_eos(tokens: list[int], eos: frozenset[int], max_new_tokens: int) -> Finished:
    for position, token in enumerate(tokens[:max_new_tokens]):
        if token in eos:
            return Finished(tokens[: position + 1], "eos")
    return Finished(tokens[:max_new_tokens], "length")


@torch.inference_mode()
def run_ordinary(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    generation: ResolvedGeneration,
    batch_rows: int,
    profile: Profile,
    timer: PhaseTimer,
) -> dict[int, Finished]:
    finished: dict[int, Finished] = {}
    for start in range(0, len(prompts), batch_rows):
        batch = prompts[start : start + batch_rows]
        for offset, result in enumerate(_generate_batch(model, batch, generation, profile, timer)):
            finished[start + offset] = result
        profile.max_active_rows = max(profile.max_active_rows, len(batch))
    return finished


def _generate_batch(model, batch, generation: ResolvedGeneration, profile: Profile, timer: PhaseTimer):
    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(batch, generation.pad_token_id, device)
    width = input_ids.shape[1]
    config = copy.deepcopy(generation.generation_config)
    processors = LogitsProcessorList()
    if generation.repetition_penalty != 1.0:
        config.repetition_penalty = 1.0  # replaced by the padding-aware processor below
        processors.append(PaddingAwareRepetitionPenalty(generation.repetition_penalty, [width - len(p) for p in batch]))
    profile.prefill_tokens += len(batch) * width
    clock = _ForwardClock(model, profile, timer)
    try:
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config, logits_processor=processors
        )
    finally:
        clock.remove()
    eos = frozenset(generation.eos_token_ids)
    return [cut_at_eos(row, eos, generation.max_new_tokens) for row in output[:, width:].tolist()]
