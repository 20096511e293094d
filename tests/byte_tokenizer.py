"""A real byte-level BPE tokenizer for the tiny models (trained offline on a seeded corpus: every id a tiny
model generates has text), and stop strings that can fire in its text."""

from __future__ import annotations

import copy
import functools
import random

from workloads import VOCAB


@functools.cache
def byte_bpe_tokenizer():
    """A byte-level BPE tokenizer with exactly VOCAB ids, trained on a seeded synthetic corpus of the letters
    a-p and `<>/_` (no network, the same merges every run): every id a tiny model generates has text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "abcdefghijklmnop<>/_"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(4000)]
    corpus = [" ".join(words[start : start + 40]) for start in range(0, len(words), 40)]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    assert len(tokenizer) == VOCAB, "the corpus must yield a full vocabulary: change it"
    return tokenizer


CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}<assistant> "


def chat_tokenizer():
    """`byte_bpe_tokenizer` with a plain chat template (a copy: the cached tokenizer is left as it is)."""
    tokenizer = copy.deepcopy(byte_bpe_tokenizer())
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


BPE_CORPUS_CHARACTERS = set("abcdefghijklmnop<>/_ ")  # what byte_bpe_tokenizer's text is made of


def corpus_piece(text: str, start: int, length: int) -> str:
    """The first run of `length` corpus characters in `text` at or after `start` (else before it): a stop
    string that can fire (a lone byte token decodes to U+FFFD, which no string matches)."""
    for begin in [*range(start, len(text)), *range(start)]:
        piece = text[begin : begin + length]
        if len(piece) == length and set(piece) <= BPE_CORPUS_CHARACTERS:
            return piece
    raise AssertionError(f"no clean {length}-character piece in {text!r}: change the workload")

