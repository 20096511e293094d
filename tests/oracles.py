"""The oracles every route must reproduce: single-request greedy `model.generate` (cached per model,
prompt and settings, so the many route tests that share a workload pay for `generate` once), HF's own
stop-string criteria, and the trainer's teacher-forced forward."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

# model -> {(prompt, max_new_tokens, penalty, eos ids): (tokens, reason)}; weak, so a freed model's id
# can never serve another model's answers
_ORACLE_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stop_string_oracle(model, tokenizer, prompt, strings, max_new_tokens: int, eos_off: bool = False):
    """Single-request HF greedy generate with stop strings (`eos_off`: no EOS; else the model's own):
    the new tokens and why it ended ("eos", "stop" by HF's own criteria, or "length")."""
    import torch
    from transformers import StopStringCriteria

    input_ids = torch.tensor([list(prompt)])
    no_eos = {"eos_token_id": None, "pad_token_id": 0} if eos_off else {}
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            do_sample=False, num_beams=1, stop_strings=strings, tokenizer=tokenizer, **no_eos,
        )  # fmt: skip
    tokens = output[0, len(prompt) :].tolist()
    if not eos_off and tokens[-1] in _eos_tuple(model, None):
        return tokens, "eos"
    return tokens, "stop" if bool(StopStringCriteria(tokenizer, strings)(output, None)[0]) else "length"


def _eos_tuple(model, eos_token_id) -> tuple[int, ...]:
    value = model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def oracle_generate(
    model,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    repetition_penalty: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    min_new_tokens: int | None = None,
) -> tuple[list[int], str]:
    """Single-request greedy `model.generate`: new tokens through the first EOS inclusive, and why it stopped.

    eos_token_id None means the model's own generation_config EOS, as for the engine; [] means none.
    min_new_tokens None leaves the model's generation_config value, as the engine does.
    Other fields of the model's generation_config apply as they would in `model.generate`.
    """
    import torch

    eos = _eos_tuple(model, eos_token_id)
    cache = _ORACLE_CACHE.setdefault(model, {})
    key = (tuple(prompt_ids), max_new_tokens, float(repetition_penalty), eos, min_new_tokens)
    if key not in cache:
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        with torch.inference_mode():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                repetition_penalty=repetition_penalty,
                eos_token_id=list(eos) if eos else None,
                pad_token_id=eos[0] if eos else 0,
                **({} if min_new_tokens is None else {"min_new_tokens": min_new_tokens}),
            )
        new_tokens = output[0, input_ids.shape[1] :].tolist()
        cache[key] = _cut_at_eos(new_tokens, eos)
    tokens, reason = cache[key]
    return list(tokens), reason



def hf_greedy(model, prompts, max_new_tokens: int, **options) -> list[list[int]]:
    """Each prompt's `max_new_tokens` new tokens from the model's own greedy `generate` (EOS off), with
    generate `options`; not cached (`oracle_generate` is, per model: here the options or the model's
    wrapped forward are what a test varies)."""
    import torch

    rows = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        with torch.inference_mode():
            output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=None, pad_token_id=0, **options)  # fmt: skip
        rows.append(output[0, len(prompt) :].tolist())
    return rows


def teacher_forced_logprobs(model, prompt: Sequence[int], tokens: Sequence[int]):
    """[len(tokens)] fp32: each generated token's log-softmax under one forward of the whole sequence (the
    trainer's view of a sample: what trainer-mode logprobs must equal)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, *tokens]])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1)[torch.arange(len(tokens)), torch.tensor(list(tokens))]


def forget_oracle(model) -> None:
    """Drop `model`'s cached oracle answers (after its weights changed)."""
    _ORACLE_CACHE.pop(model, None)


def forget_all_oracles() -> None:
    """Drop every cached oracle answer (after a shared model was changed and rebuilt)."""
    _ORACLE_CACHE.clear()


def _cut_at_eos(tokens: list[int], eos: tuple[int, ...]) -> tuple[list[int], str]:
    for position, token in enumerate(tokens):
        if token in eos:
            return tokens[: position + 1], "eos"
    return tokens, "length"


def oracle_batch(model, prompts, max_new_tokens, repetition_penalty=1.0, eos_token_id=None):
    """`oracle_generate` for every prompt: (tokens per prompt, finish reason per prompt)."""
    pairs = [oracle_generate(model, p, max_new_tokens, repetition_penalty, eos_token_id) for p in prompts]
    return [t for t, _ in pairs], [r for _, r in pairs]


def mismatches(result_tokens, expected_tokens) -> list[int]:
    """Prompt indices whose tokens differ from the oracle's (length difference counts)."""
    assert len(result_tokens) == len(expected_tokens)
    return [
        i for i, (got, want) in enumerate(zip(result_tokens, expected_tokens, strict=True)) if got != want
    ]


def assert_matches_oracle(result, expected_tokens, expected_reasons) -> None:
    wrong = mismatches(result.tokens, expected_tokens)
    detail = "; ".join(f"prompt {i}: got {result.tokens[i]} want {expected_tokens[i]}" for i in wrong[:3])
    assert not wrong, f"{len(wrong)} of {len(expected_tokens)} prompts differ from model.generate: {detail}"
    assert result.finish_reasons == expected_reasons

