"""Prefill of one padded group of prompts (the planner's "bucket"): left-padded to its longest prompt, one forward.

The forward goes through the model's own cache path (a fresh DynamicCache), exactly as HF
`generate` prefills a left-padded batch: 2-D attention mask, position ids counted over real tokens
only, and `logits_to_keep=1` (full logits are a [B, L, vocab] head GEMM and tensor, on a small model
several times the rest of the forward).
The returned per-layer K/V is then copied right-aligned into the static cache by the caller."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autobucket.engine.intercept.grad_mode import without_autograd
from autobucket.engine.model_access.hf_compat import (
    ForwardSpec,
    full_prefill_cache,
    layer_key_values,
    output_cache,
)
from autobucket.planning.forms import PADDED

# The forms (planning/forms.py): PADDED = prompts left-padded to the longest, one row each, one
# forward (here); PACKED = prompts concatenated in one row, one forward (packed_prefill.py);
# CHUNKED = one prompt in forwards of at most the token budget (chunked_prefill.py).


@dataclass(frozen=True)
class PrefillGroup:
    """Prompt indices prefilled together, and how (one of FORMS)."""

    prompts: tuple[int, ...]
    form: str = PADDED
    chunk_tokens: int | None = None  # chunked: most tokens per forward


def as_group(group: Sequence[int] | PrefillGroup) -> PrefillGroup:
    """An admission policy's group: a plain sequence of prompt indices is a padded group."""
    return group if isinstance(group, PrefillGroup) else PrefillGroup(tuple(group))


@dataclass
class PrefillOutput:
    keys: list[torch.Tensor]  # per layer [output_rows, kv_heads, width, head_dim]
    values: list[torch.Tensor]
    last_logits: torch.Tensor  # [prompts, vocab] fp32, logits at each prompt's last token
    # Per prompt: (output row, first column, end column) of its K/V. None: padded, prompt b is row b,
    # right-aligned (its last len(prompt) columns).
    segments: list[tuple[int, int, int]] | None = None
    # Continued prefills: per prompt, the prefix shared inside the call it continues (None: its own or
    # cached K/V), so its cache rows can read that prefix's one copy.
    shared_prefixes: list[Any] | None = None
    forwards: int = 1  # model forwards it took
    tokens: int = 0  # token positions run through them (padding included)

    def prompt_key_values(
        self, prompt: int, length: int, start: int, copy: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Prompt `prompt`'s K/V (`length` tokens) from its token `start` on, per layer [kv_heads, length - start,
        head_dim]: views of this output, or with `copy` tensors of their own (that do not keep it alive)."""
        if self.segments is None:
            row, begin = prompt, self.keys[0].shape[2] - length
        else:
            row, begin, _ = self.segments[prompt]
        columns = slice(begin + start, begin + length)
        keys, values = [k[row, :, columns] for k in self.keys], [v[row, :, columns] for v in self.values]
        if copy:
            return [k.clone() for k in keys], [v.clone() for v in values]
        return keys, values


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask `[rows, width]`, real tokens right-aligned."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """True position of every real token; padding gets 1, as in HF generate (it is masked anyway)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


@without_autograd
def prefill_padded(
    model: torch.nn.Module, spec: ForwardSpec, prompts: Sequence[Sequence[int]], pad_token_id: int
) -> PrefillOutput:
    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(prompts, pad_token_id, device)
    kwargs = {"logits_to_keep": 1} if spec.accepts_logits_to_keep else {}
    kwargs.update(full_prefill_cache(model, spec))
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions_from_mask(attention_mask),
        use_cache=True,
        **kwargs,
    )
    keys, values = layer_key_values(output_cache(output))
    return PrefillOutput(keys, values, output.logits[:, -1, :].float(), tokens=input_ids.numel())
