"""Turn what callers pass as prompts into validated token-id lists, failing with the prompt index."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence, Sized
from typing import Any

import numpy as np
import torch


def normalize_prompts(prompts: Sequence[Any], tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Token-id lists from lists/tuples of ints (numpy's included), 1-D integer tensors or numpy arrays,
    strings (with a tokenizer), or chat messages (with a tokenizer that has a chat template:
    `conversation_ids`); or a tokenizer's batch output, a mapping with "input_ids" and "attention_mask":
    padded on the left (`tokenizer(texts, padding=True, return_tensors="pt")`) or unpadded lists
    (`tokenizer(texts)`). Without "attention_mask", "input_ids" must be a list of rows, each all prompt:
    a 2-D tensor or array is refused, as it is passed bare, since its padding cannot be told apart."""
    if isinstance(prompts, Mapping) and "input_ids" in prompts:
        prompts = _batch_prompts(prompts)
    if isinstance(prompts, (torch.Tensor, np.ndarray)) and prompts.ndim == 2:
        raise ValueError(
            f"prompts is a 2-D {type(prompts).__name__} of shape {tuple(prompts.shape)}: pass list(input_ids) "
            "when its rows have no padding, or generate_padded(input_ids, attention_mask) for a left-padded batch"
        )
    if isinstance(prompts, (str, torch.Tensor, np.ndarray)) or not isinstance(prompts, Sequence):
        raise ValueError(
            f"prompts must be a list of prompts (token-id lists, 1-D tensors, strings or chat message lists) or a "
            f'tokenizer\'s batch output with "input_ids", got {type(prompts).__name__}'
        )
    return [_prompt_ids(index, prompt, tokenizer, vocab_size) for index, prompt in enumerate(prompts)]


def _batch_prompts(batch: Mapping[str, Any]) -> Any:
    """A tokenizer's batch output -> its rows of prompt tokens (still to be checked as prompts)."""
    input_ids = batch["input_ids"]
    if "attention_mask" in batch:
        return unpad_left_padded(input_ids, batch["attention_mask"])
    if isinstance(input_ids, (torch.Tensor, np.ndarray)) and input_ids.ndim == 2:
        raise ValueError(
            f'prompts["input_ids"] is a 2-D {type(input_ids).__name__} of shape {tuple(input_ids.shape)} without '
            '"attention_mask", so its padding would be taken as prompt tokens: pass the tokenizer\'s whole output '
            '(tokenizer(texts, padding=True, return_tensors="pt") carries the mask; pad on the left), or '
            'list(input_ids) when its rows have no padding'
        )
    return input_ids  # rows (lists or 1-D tensors): each is all prompt


def check_tokenizer(tokenizer: Any) -> None:
    """A TypeError unless `tokenizer` is None or callable like a HF tokenizer; it names the common slip of
    passing a config in the tokenizer's place (`Rollout(model, RolloutConfig(...))`)."""
    if tokenizer is None or callable(tokenizer):
        return
    kind = type(tokenizer).__name__
    if kind.endswith("Config"):
        raise TypeError(
            f"tokenizer is a {kind}: pass it by keyword, Rollout(model, config={kind}(...)), "
            "or Rollout(model, tokenizer, config)"
        )
    raise TypeError(f"tokenizer must be a Hugging Face tokenizer (callable on a string) or None, got {kind}")


def _starts_with_bos(text: str, tokenizer: Any) -> bool:
    """Whether the text already begins with the tokenizer's BOS token (`apply_chat_template(...,
    tokenize=False)` writes it for Llama, Gemma, Mistral): adding special tokens again would give the
    model two BOS ids, which it never saw in training, so such text is tokenized without them."""
    bos = getattr(tokenizer, "bos_token", None)
    return isinstance(bos, str) and bool(bos) and text.startswith(bos)


def is_conversation(prompt: Any) -> bool:
    """Whether `prompt` is chat messages (a non-empty list of {"role": ..., "content": ...} dicts)."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, Mapping) for m in prompt)


def message_problem(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """What is wrong with the first message that lacks a "role" string or a "content" (None: nothing)."""
    for position, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or "content" not in message:
            return f"message {position} must have a \"role\" string and a \"content\", got {dict(message)!r}"
    return None


def conversation_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], where: str = "the conversation") -> list[int]:
    """Chat `messages` as token ids through the tokenizer's chat template: ready for the assistant's next
    message (`add_generation_prompt`), or, when the last message is the assistant's, continuing it
    (`continue_final_message`: a prefilled answer). The rendered text is tokenized without special
    tokens (the template writes them), as TRL tokenizes conversational prompts."""
    if tokenizer is None:
        raise ValueError(f"{where} is chat messages but there is no tokenizer to apply a chat template: pass tokenizer=...")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{where} is chat messages but the tokenizer has no chat template: set tokenizer.chat_template "
            "or pass token ids"
        )
    problem = message_problem(messages)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    continues = messages[-1]["role"] == "assistant"
    rendered = tokenizer.apply_chat_template(
        [dict(message) for message in messages],
        tokenize=False,
        add_generation_prompt=not continues,
        continue_final_message=continues,
    )
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def _prompt_ids(index: int, prompt: Any, tokenizer: Any, vocab_size: int) -> list[int]:
    if is_conversation(prompt):
        ids = conversation_ids(tokenizer, prompt, f"prompt {index}")
    elif isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompt {index} is a string but the Rollout has no tokenizer: pass tokenizer=...")
        ids = tokenizer(prompt, add_special_tokens=not _starts_with_bos(prompt, tokenizer))["input_ids"]
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point:
            raise ValueError(
                f"prompt {index} must be a 1-D integer tensor, got shape {tuple(prompt.shape)} and dtype "
                f"{prompt.dtype}: pass token ids (.long() on a float tensor of ids)"
            )
        ids = prompt.tolist()
    elif isinstance(prompt, np.ndarray):  # a `datasets` column in numpy format, for one
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise ValueError(
                f"prompt {index} must be a 1-D integer array, got shape {prompt.shape} and dtype {prompt.dtype}"
            )
        ids = prompt.tolist()
    elif isinstance(prompt, Sequence):
        ids = list(prompt)
    elif isinstance(prompt, Mapping):
        raise ValueError(
            f"prompt {index} is one chat message: pass each conversation as a list of messages, "
            "prompts=[[{'role': 'user', 'content': ...}], ...]"
        )
    else:
        raise ValueError(f"prompt {index} has type {type(prompt).__name__}: pass token ids, a 1-D tensor or a string")
    if not ids:
        raise ValueError(f"prompt {index} is empty: every prompt needs at least one token")
    return [_token_id(index, token, vocab_size) for token in ids]


def _token_id(index: int, token: Any, vocab_size: int) -> int:
    """`token` as a Python int (numpy's integers included), or a ValueError naming prompt `index`."""
    try:
        token_id = None if isinstance(token, bool) else operator.index(token)
    except TypeError:
        token_id = None
    if token_id is None:
        raise ValueError(f"prompt {index} has token id {token!r}, a {type(token).__name__}: token ids are integers")
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"prompt {index} has token id {token_id} outside the vocabulary [0, {vocab_size})")
    return token_id


def check_context(prompts: list[list[int]], budgets: Sequence[int], max_positions: int | None) -> None:
    """Each prompt plus its own budget (`SamplingConfig.request_budgets`) fits the model's positions."""
    if max_positions is None:
        return
    for index, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        if len(prompt) + budget > max_positions:
            raise ValueError(
                f"prompt {index} has {len(prompt)} tokens; with max_new_tokens={budget} it needs "
                f"{len(prompt) + budget} positions but the model has {max_positions}: shorten it or lower "
                "max_new_tokens"
            )


def unpad_left_padded(
    input_ids: torch.Tensor | np.ndarray | Sequence[Sequence[int]],
    attention_mask: torch.Tensor | np.ndarray | Sequence[Sequence[int]],
) -> list[list[int]]:
    """RL-trainer layout -> prompts: rows of a left-padded [batch, width] tensor (or numpy array) and its
    mask; or a tokenizer's unpadded batch, lists of rows of different lengths, each with its mask row."""
    if _ragged(input_ids) or _ragged(attention_mask):
        id_rows, mask_rows = _ragged_rows(input_ids, attention_mask)
    else:
        id_rows, mask_rows = _padded_rows(input_ids, attention_mask)
    prompts = []
    for row, (ids, mask) in enumerate(zip(id_rows, mask_rows, strict=True)):
        real = [token for token, keep in zip(ids, mask, strict=True) if keep]
        if mask != [0] * (len(mask) - len(real)) + [1] * len(real):
            raise ValueError(f"row {row} of attention_mask {_mask_problem(mask)}")
        if not real:
            raise ValueError(f"row {row} of attention_mask has no ones: every row needs at least one prompt token")
        prompts.append(real)
    return prompts


def _padded_rows(input_ids: Any, attention_mask: Any) -> tuple[list[list], list[list]]:
    input_ids, attention_mask = torch.as_tensor(input_ids), torch.as_tensor(attention_mask)
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}: pass a LongTensor")
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must be the "
            "same 2-D [batch, width] shape"
        )
    return input_ids.tolist(), attention_mask.tolist()


def _ragged(rows: Any) -> bool:
    """Rows of different lengths in a list (what a tokenizer returns for texts without padding)."""
    if not isinstance(rows, (list, tuple)) or not all(isinstance(row, Sized) for row in rows):
        return False
    return len({len(row) for row in rows}) > 1


def _ragged_rows(input_ids: Any, attention_mask: Any) -> tuple[list[list], list[list]]:
    """Each row of ids with its own mask row, as lists; the two must pair up row by row."""
    if not isinstance(input_ids, (list, tuple)) or not isinstance(attention_mask, (list, tuple)):
        raise ValueError(
            f"input_ids is a {type(input_ids).__name__} and attention_mask a {type(attention_mask).__name__} with "
            "rows of different lengths: pass both as the tokenizer returned them, or pad them on the left "
            '(tokenizer(texts, padding=True, return_tensors="pt"))'
        )
    if len(input_ids) != len(attention_mask):
        raise ValueError(f"input_ids has {len(input_ids)} rows but attention_mask {len(attention_mask)}: pass one mask row per row")
    id_rows, mask_rows = [_row_list(row) for row in input_ids], [_row_list(row) for row in attention_mask]
    for row, (ids, mask) in enumerate(zip(id_rows, mask_rows, strict=True)):
        if len(ids) != len(mask):
            raise ValueError(f"row {row} has {len(ids)} input_ids but {len(mask)} attention_mask values: pass its own mask row")
    return id_rows, mask_rows


def _row_list(row: Any) -> list:
    return row.tolist() if isinstance(row, (torch.Tensor, np.ndarray)) else list(row)


def _mask_problem(mask: list) -> str:
    """What is wrong with a mask row that is not zeros then ones, in words that point at the fix."""
    ones = sum(1 for value in mask if value)
    if set(mask) <= {0, 1} and mask == [1] * ones + [0] * (len(mask) - ones):
        return "is right-padded (ones, then zeros): pad on the left (tokenizer.padding_side = 'left'), as RL trainers do"
    shown = ", ".join(str(value) for value in mask[:12]) + (", ..." if len(mask) > 12 else "")
    return f"is not left-padded (zeros, then ones): [{shown}]"


def random_prompts(lengths: Sequence[int], vocab_size: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    """Random token ids (fixed seed) so that a wrong route would change tokens, unlike a repeated id."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (length,), generator=generator).tolist() for length in lengths]
