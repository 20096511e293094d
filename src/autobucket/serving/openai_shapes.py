"""The OpenAI response bodies (completions and chat, whole and streamed) built from engine results.

Finish reasons: "eos" and "stop" are OpenAI's "stop", "length" stays, an aborted request's is "abort"
(vLLM's word). Each choice also carries `token_ids` (the ids the text decodes from), which RL clients need
and OpenAI's clients ignore. Logprobs are the sampled tokens' only (no alternatives), under the engine's
`SamplingConfig.logprobs_mode` ("trainer": log_softmax(logits / temperature) of the model's raw logits)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from autobucket.serving.request import RequestOutput

OPENAI_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", None: None}


class TextDecoder:
    """A sequence's text as its tokens arrive: each call returns only the new text, holding back an
    incomplete character (a byte-level token can end mid-character: its text ends in U+FFFD)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.tokens, self.text = tokenizer, [], ""

    def add(self, tokens: Sequence[int], final: bool = False) -> str:
        self.tokens.extend(tokens)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        new, self.text = text[len(self.text) :], text
        return new


def decode(tokenizer: Any, tokens: Sequence[int]) -> str:
    return TextDecoder(tokenizer).add(tokens, final=True)


def usage(prompt_tokens: int, outputs: Sequence[RequestOutput]) -> dict[str, int]:
    completion = sum(len(o.tokens) for o in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def completion_body(completion_id: str, model: str, outputs: Sequence[RequestOutput], tokenizer: Any) -> dict:
    choices = [
        {
            "index": index, "text": decode(tokenizer, o.tokens), "token_ids": o.tokens,
            "logprobs": _completion_logprobs(tokenizer, o) if o.logprobs is not None else None,
            "finish_reason": OPENAI_REASONS[o.finish_reason],
        }  # fmt: skip
        for index, o in enumerate(outputs)
    ]
    return {
        "id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": choices, "usage": usage(len(outputs[0].prompt_ids), outputs),
    }  # fmt: skip


def chat_body(completion_id: str, model: str, outputs: Sequence[RequestOutput], tokenizer: Any) -> dict:
    choices = [
        {
            "index": index, "message": {"role": "assistant", "content": decode(tokenizer, o.tokens)},
            "token_ids": o.tokens, "logprobs": _chat_logprobs(tokenizer, o) if o.logprobs is not None else None,
            "finish_reason": OPENAI_REASONS[o.finish_reason],
        }  # fmt: skip
        for index, o in enumerate(outputs)
    ]
    return {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": choices, "usage": usage(len(outputs[0].prompt_ids), outputs),
    }  # fmt: skip


def completion_chunk(completion_id: str, model: str, index: int, text: str, tokens, logprobs, reason) -> dict:
    choice = {"index": index, "text": text, "token_ids": tokens, "finish_reason": OPENAI_REASONS[reason],
              "logprobs": None if logprobs is None else {"token_logprobs": logprobs}}  # fmt: skip
    return {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}


def chat_chunk(completion_id: str, model: str, index: int, delta: dict, tokens, reason) -> dict:
    choice = {"index": index, "delta": delta, "token_ids": tokens, "finish_reason": OPENAI_REASONS[reason], "logprobs": None}
    return {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model, "choices": [choice]}


def _token_texts(tokenizer: Any, tokens: Sequence[int]) -> list[str]:
    return [decode(tokenizer, [token]) for token in tokens]


def _completion_logprobs(tokenizer: Any, output: RequestOutput) -> dict:
    texts = _token_texts(tokenizer, output.tokens)
    offsets = [0, *itertools.accumulate(len(text) for text in texts)][: len(texts)]
    return {"tokens": texts, "token_logprobs": output.logprobs, "top_logprobs": None, "text_offset": offsets}


def _chat_logprobs(tokenizer: Any, output: RequestOutput) -> dict:
    texts = _token_texts(tokenizer, output.tokens)
    return {
        "content": [
            {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
            for text, logprob in zip(texts, output.logprobs, strict=True)
        ]
    }
