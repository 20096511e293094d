"""Logits processors applied to one sequence at a time, on every route: the GenerationConfig options HF
applies through its processors (sequence_bias, no_repeat_ngram_size, bad_words_ids, min_length,
suppress_tokens, begin_suppress_tokens), `prefix_allowed_tokens_fn`, and a caller's own `logits_processor`.

Each is HF's own class (or the caller's object), called with one sequence's ids `[1, length]` (its prompt
and the tokens generated so far, no padding) and that sequence's scores `[1, vocab]`: what a
single-request `model.generate` hands it, so a sequence's tokens depend on that sequence alone, never on
its batch, route or refill order. (HF's batched `generate` hands processors the left-padded batch: its
n-gram bans and `min_length` read the padding as tokens.)

Order, as HF's `_get_logits_processor` builds it: sequence_bias, the repetition penalty, then the rest in
its order, then the caller's processors (HF appends them; one of the same class as a built-in one
replaces it), then the warpers. The penalty and the EOS suppression of `min_new_tokens` are applied by
`Selection`; every processor after the penalty only sets scores to -inf (or adds 0), so they commute
with it: only sequence_bias, which adds, must come first."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

# The GenerationConfig options applied here (each is off at None), in HF's order.
ROW_PROCESSOR_OPTIONS = (
    "sequence_bias", "no_repeat_ngram_size", "bad_words_ids", "min_length", "suppress_tokens", "begin_suppress_tokens",
)  # fmt: skip
# generate() keywords (not GenerationConfig fields) that carry processors
PROCESSOR_KEYWORDS = ("logits_processor", "prefix_allowed_tokens_fn")

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids [1, length], scores [1, vocab]) -> scores


@dataclass(frozen=True)
class RowProcessors:
    """One call's per-sequence processors (`row_processors` builds them; None there when there are none)."""

    first: tuple[Processor, ...]  # before the repetition penalty (sequence_bias)
    rest: tuple[Processor, ...]  # after it: the built-in masks in HF's order, then the caller's
    # built-in masks that read no ids (suppress_tokens): one call on all rows, the same values elementwise
    every_row: tuple[Processor, ...] = ()
    begin_suppress: SuppressTokensAtBeginLogitsProcessor | None = None  # at each sequence's first new token
    allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None  # prefix_allowed_tokens_fn

    @property
    def reads_histories(self) -> bool:
        """Whether any processor reads a sequence's ids (the every-row masks do not)."""
        return bool(self.first or self.rest or self.begin_suppress or self.allowed_tokens_fn)

    def apply_first(self, logits: torch.Tensor, histories: Sequence[Any], prompts: Sequence[int]) -> torch.Tensor:
        """logits [rows, vocab] fp32 -> a processed copy (the processors before the penalty), or `logits`."""
        if not self.first:
            return logits
        return self._each_row(logits, histories, lambda row, ids, scores: _run(self.first, ids, scores))

    def apply_rest(
        self, logits: torch.Tensor, histories: Sequence[Any], prompts: Sequence[int], steps: Sequence[int],
        in_place: bool = False,
    ) -> torch.Tensor:
        """logits [rows, vocab] fp32 -> processed (every processor after the penalty): a copy, or `logits`
        itself written where `in_place` (the penalty's or the EOS mask's copy already)."""
        if self.every_row:
            # masks first: they commute with the per-row ones (all only set -inf), and the caller's stay last
            logits, in_place = _run(self.every_row, torch.empty(logits.shape[0], 0, dtype=torch.long), logits), True
        if not (self.rest or self.begin_suppress or self.allowed_tokens_fn):
            return logits  # nothing after the penalty reads ids (every-row masks only, or none)

        def rest(row: int, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.allowed_tokens_fn is not None:
                # HF's class, with batch_id = the prompt's index in the call (HF passes the row's index in
                # its batch, which a route-invariant call cannot: a single-request generate passes 0)
                prompt, function = prompts[row], self.allowed_tokens_fn
                scores = PrefixConstrainedLogitsProcessor(lambda _batch_id, sent: function(prompt, sent), 1)(ids, scores)
            if self.begin_suppress is not None and steps[row] == 0:
                self.begin_suppress.set_begin_index(ids.shape[-1])  # the sequence's prompt length
                scores = self.begin_suppress(ids, scores)
            return _run(self.rest, ids, scores)

        return self._each_row(logits, histories, rest, in_place)

    @staticmethod
    def _each_row(logits: torch.Tensor, histories: Sequence[Any], process, in_place: bool = False) -> torch.Tensor:
        """`process(row, ids [1, length], scores [1, vocab])` on each row of a copy of `logits` (a processor
        that writes in place then writes the copy, never the raw logits trainer logprobs are read from), or
        of `logits` itself where `in_place`."""
        processed = logits if in_place else logits.clone()
        for row, history in enumerate(histories):
            ids = torch.as_tensor(history, dtype=torch.long, device=logits.device)[None]
            scores = process(row, ids, processed[row : row + 1])
            if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (1, logits.shape[-1]):
                shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
                raise ValueError(
                    f"a logits processor returned {shape} for one sequence's scores [1, {logits.shape[-1]}]: each "
                    "processor must return scores of the shape it is given"
                )
            if scores.data_ptr() != processed[row].data_ptr():
                processed[row] = scores[0]
        return processed


def _run(processors: Sequence[Processor], ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    for processor in processors:
        scores = processor(ids, scores)
    return scores


def row_processors(
    config: Any, custom: Any, allowed_tokens_fn: Any, eos_token_ids: Sequence[int], vocab_size: int, device: torch.device
) -> RowProcessors | None:
    """The call's processors from the resolved GenerationConfig `config` (its ROW_PROCESSOR_OPTIONS, which
    are then cleared so that HF's batched `generate` never applies them itself), the caller's
    `logits_processor` (`custom`: one processor, a list, or None) and `prefix_allowed_tokens_fn`; None when
    there are none. Bad values raise ValueError naming the option before anything runs."""
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long)
    built: list[Processor] = []
    first: list[Processor] = []
    begin = None
    if config.sequence_bias is not None:
        _check_sequence_bias(config.sequence_bias, vocab_size)
        first.append(SequenceBiasLogitsProcessor(sequence_bias=config.sequence_bias))
    if config.no_repeat_ngram_size is not None and config.no_repeat_ngram_size > 0:
        built.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        _check_ids("bad_words_ids", [token for word in config.bad_words_ids for token in word], vocab_size)
        built.append(NoBadWordsLogitsProcessor(config.bad_words_ids, eos))
    if config.min_length is not None and config.min_length > 0 and len(eos_token_ids) > 0:
        built.append(MinLengthLogitsProcessor(config.min_length, eos, device=str(device)))
    if config.suppress_tokens is not None:
        _check_ids("suppress_tokens", config.suppress_tokens, vocab_size)
        built.append(SuppressTokensLogitsProcessor(config.suppress_tokens, device=str(device)))
    if config.begin_suppress_tokens is not None:
        _check_ids("begin_suppress_tokens", config.begin_suppress_tokens, vocab_size)
        begin = SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, 0, device=str(device))
    for option in ROW_PROCESSOR_OPTIONS:
        setattr(config, option, None)
    callers = _caller_processors(custom)
    if allowed_tokens_fn is not None and not callable(allowed_tokens_fn):
        raise ValueError(
            f"prefix_allowed_tokens_fn={allowed_tokens_fn!r} is not callable: pass a function (prompt index, ids) "
            "-> allowed token ids"
        )
    # a caller's processor of a built-in's class replaces it where it stands (HF's merge)
    replaced = {type(p) for p in callers}
    first = [next((c for c in callers if type(c) is type(p)), p) for p in first]
    built = [next((c for c in callers if type(c) is type(p)), p) for p in built]
    callers = [c for c in callers if not any(c is p for p in (*first, *built))]
    if begin is not None and SuppressTokensAtBeginLogitsProcessor in replaced:
        begin = None  # the caller's own (with its own begin_index) runs among theirs
    if not (first or built or callers or begin or allowed_tokens_fn):
        return None
    every_row = tuple(p for p in built if type(p) is SuppressTokensLogitsProcessor)
    per_row = tuple(p for p in built if type(p) is not SuppressTokensLogitsProcessor)
    return RowProcessors(tuple(first), (*per_row, *callers), every_row, begin_suppress=begin, allowed_tokens_fn=allowed_tokens_fn)


def _caller_processors(custom: Any) -> list[Processor]:
    if custom is None:
        return []
    processors = [custom] if callable(custom) and not isinstance(custom, list) else list(custom)
    for index, processor in enumerate(processors):
        if not callable(processor):
            raise ValueError(
                f"logits_processor[{index}]={processor!r} is not callable: pass transformers LogitsProcessor "
                "objects (or callables (input_ids [1, length], scores [1, vocab]) -> scores)"
            )
    return processors


def _check_ids(option: str, ids: Sequence[Any], vocab_size: int) -> None:
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise ValueError(
                f"generation option {option} holds {token!r}, which is not a token id of this model (0 .. "
                f"{vocab_size - 1}): pass token ids from its tokenizer"
            )


def _check_sequence_bias(sequence_bias: Any, vocab_size: int) -> None:
    """Token ids of sequence_bias in either of HF's forms ({(ids...): bias} or [[[ids...], bias], ...])."""
    if isinstance(sequence_bias, dict):
        sequences = list(sequence_bias)
    elif isinstance(sequence_bias, list):
        sequences = [entry[0] for entry in sequence_bias if isinstance(entry, (list, tuple)) and entry]
    else:
        raise ValueError(
            f"generation option sequence_bias={sequence_bias!r} must map token-id sequences to biases: "
            "{(id, ...): bias} or [[[id, ...], bias], ...]"
        )
    for sequence in sequences:
        if isinstance(sequence, (list, tuple)):
            _check_ids("sequence_bias", sequence, vocab_size)
