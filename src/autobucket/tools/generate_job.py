"""`autobucket generate` as library functions: a prompts file -> token ids -> `Rollout` -> JSONL.

The input is parsed and checked completely before the model loads, so a bad line fails at once and
names its line (`FILE:LINE:`). The output is written to a temporary file and renamed only after every
prompt has finished, so a failed run never leaves a partial output file; an interrupted one (Ctrl-C)
writes the rows of the prompts that had finished, so the time spent is not lost. Prompts run in chunks of a few
continuous batches (one `generate` call each) only so that progress can be reported; tokens do not
depend on the chunking: every route is exact per request, and each chunk passes its prompts the stream
keys one call over the whole file would give them, so sampled tokens are the same too."""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from autobucket.checks import optional_int, require_bool
from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.prompts import conversation_ids
from autobucket.tools.generate_output import (
    STDIO,
    Sample,
    check_output_path,
    output_rows,
    prompt_samples,
    write_jsonl,
)
from autobucket.tools.prompt_file import PromptRecord, read_prompts

INPUT_FORMATS = ("auto", "jsonl", "txt")
CHUNK_BATCHES = 4  # continuous batches per generate call: progress granularity for long runs

Progress = Callable[[int, int], None]  # (finished prompts, all prompts)


@dataclass(frozen=True)
class GenerateJob:
    """What `autobucket generate` does; `prompts` and `out` are paths or "-" for stdin / stdout; `model`
    and its loading options (`model` to `threads`) as `autobucket.load_model` takes them."""

    prompts: str
    out: str = STDIO
    model: str = "smollm2"
    input_format: str = "auto"
    chat: bool = False
    trust_remote_code: bool = False
    dtype: str = "float32"
    device: str = "cpu"
    attn_implementation: str = "sdpa"
    threads: int | None = None  # torch CPU threads (None: torch's)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(route="auto"))
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    chunk_prompts: int | None = None  # prompts per generate call (None: CHUNK_BATCHES continuous batches)
    # GenerationConfig fields for every call (`Rollout.generate`'s overrides: logits processors such as
    # no_repeat_ngram_size, suppress_tokens, bad_words_ids, sequence_bias), validated by the first call
    generation_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_format not in INPUT_FORMATS:
            raise ValueError(f"input_format={self.input_format!r} is invalid: choose one of {', '.join(INPUT_FORMATS)}")
        optional_int("chunk_prompts", self.chunk_prompts, fix="use None for a few continuous batches per call")
        require_bool("chat", self.chat)
        require_bool("trust_remote_code", self.trust_remote_code)
        if not isinstance(self.generation_options, dict) or not all(isinstance(k, str) for k in self.generation_options):
            raise ValueError(
                f"generation_options={self.generation_options!r} is invalid: expected a dict of "
                "GenerationConfig field names to values"
            )


# ------------------------------------------------------------------ input
def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """`text` as one user turn in the tokenizer's chat template, ready for the assistant's answer."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template: drop --chat (the prompts are then used as plain text)")
    return conversation_ids(tokenizer, [{"role": "user", "content": text}])


def encode_prompts(
    records: Sequence[PromptRecord], tokenizer: Any, chat: bool, vocab_size: int, model_name: str = "the model"
) -> list[list[int]]:
    """Token ids per record; text needs a tokenizer, `chat` applies its chat template."""
    encoded = []
    for record in records:
        if record.ids is not None:
            if chat:
                raise ValueError(
                    f"{record.where}: --chat applies to text prompts but this line gives prompt_ids; "
                    "drop --chat or give the text as \"prompt\""
                )
            ids = record.ids
        elif tokenizer is None:
            kind = "chat messages" if record.messages is not None else "a text prompt"
            raise ValueError(
                f"{record.where}: {kind}, but {model_name} has no tokenizer: give token ids as "
                '{"prompt_ids": [...]}'
            )
        elif record.messages is not None:  # templated whether or not --chat is given
            ids = conversation_ids(tokenizer, record.messages, record.where)
        else:
            assert record.text is not None, "read_prompts gives every record its ids or its text"
            ids = chat_prompt_ids(tokenizer, record.text) if chat else tokenizer(record.text)["input_ids"]
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"{record.where}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        encoded.append(list(ids))
    return encoded


def check_context_fits(
    records: Sequence[PromptRecord], prompts: Sequence[list[int]], sampling: SamplingConfig, max_positions: int | None
) -> None:
    """Each prompt plus its budget fits the model's positions; the error names the line and the budget
    it took: the line's own "max_new_tokens" or the job's (--max-new-tokens)."""
    if max_positions is None:
        return
    job_budgets = sampling.request_budgets(len(records))
    for record, ids, job_budget in zip(records, prompts, job_budgets, strict=True):
        budget = record.max_new_tokens or job_budget
        if len(ids) + budget <= max_positions:
            continue
        given, fix = (
            (f'its "max_new_tokens": {budget}', 'this line\'s "max_new_tokens"')
            if record.max_new_tokens
            else (f"--max-new-tokens {budget}", "--max-new-tokens")
        )
        raise ValueError(
            f"{record.where}: the prompt has {len(ids)} tokens; with {given} it needs "
            f"{len(ids) + budget} positions but the model has {max_positions}: shorten it or lower {fix}"
        )


# ------------------------------------------------------------------ run
class GenerateInterrupted(KeyboardInterrupt):
    """Ctrl-C (KeyboardInterrupt) while `run_generate_job` generated, after the rows of the `finished`
    prompts (the chunks that had returned) were written to `out`; nothing was written when it is 0."""

    def __init__(self, finished: int, total: int, out: str) -> None:
        super().__init__(finished, total, out)
        self.finished, self.total, self.out = finished, total, out

    def __str__(self) -> str:
        if not self.finished:
            return f"interrupted before any of the {self.total} prompts finished: nothing written"
        target = "stdout" if self.out == STDIO else repr(self.out)
        return f"interrupted: wrote the rows of the first {self.finished} of {self.total} prompts to {target}"


def run_generate_job(job: GenerateJob, on_progress: Progress | None = None) -> dict[str, Any]:
    """Read, generate, write; returns the summary (route, buckets, times, tokens/s). Interrupted, it
    writes the finished prompts' rows and raises `GenerateInterrupted`."""
    from autobucket.engine.rollout import Rollout
    from autobucket.models import load_model

    records = read_prompts(job.prompts, job.input_format)
    check_output_path(job.out, job.prompts)
    started = time.perf_counter()
    model, tokenizer = load_model(job.model, dtype=job.dtype, device=job.device, threads=job.threads,
                                  attn_implementation=job.attn_implementation, trust_remote_code=job.trust_remote_code)
    load_s = time.perf_counter() - started
    if job.sampling.stop_strings and tokenizer is None:
        raise ValueError(
            f"--stop {job.sampling.stop_strings!r} needs a tokenizer to match text, and {job.model!r} has none: "
            "use a model folder or HF id saved with its tokenizer, or drop --stop"
        )
    rollout = Rollout(model, tokenizer, job.rollout)
    prompts = encode_prompts(records, tokenizer, job.chat, rollout.vocab_size, repr(job.model))
    check_context_fits(records, prompts, job.sampling, rollout.max_positions)
    chunk = job.chunk_prompts or CHUNK_BATCHES * job.sampling.continuous_batch_size
    results: list[Any] = []
    started = time.perf_counter()
    try:
        generate_in_chunks(
            rollout,
            prompts,
            record_sampling(job.sampling, records),
            chunk,
            on_progress,
            job.generation_options,
            results,
        )
    except KeyboardInterrupt:
        raise _write_finished(job, records, results, tokenizer) from None
    except ValueError as exc:
        named = _named_by_line(exc, records[sum(len(r.tokens) for r in results) :])
        if named is exc:
            raise
        raise named from exc
    generate_s = time.perf_counter() - started
    samples = prompt_samples(results, job.sampling.n)
    write_jsonl(output_rows(records, samples, tokenizer), job.out)
    return summarize(job, prompts, results, samples, load_s, generate_s)


def _write_finished(
    job: GenerateJob, records: Sequence[PromptRecord], results: Sequence[Any], tokenizer: Any
) -> GenerateInterrupted:
    """Write the rows of the prompts whose chunk had returned (input order: the first `finished`)."""
    samples = prompt_samples(results, job.sampling.n)
    if samples:
        write_jsonl(output_rows(records[: len(samples)], samples, tokenizer), job.out)
    return GenerateInterrupted(len(samples), len(records), job.out)


_PROMPT_INDEX = re.compile(r"\bprompt (\d+)\b")


def _named_by_line(error: ValueError, chunk: Sequence[PromptRecord]) -> ValueError:
    """A chunk's error that names a prompt by its index in the chunk ("prompt 1 has ..."), with that
    prompt's FILE:LINE instead; any other error unchanged."""
    indices = {int(index) for index in _PROMPT_INDEX.findall(str(error))}
    if not indices or max(indices) >= len(chunk):
        return error
    if len(indices) == 1:
        (index,) = indices
        return ValueError(f"{chunk[index].where}: {_PROMPT_INDEX.sub('the prompt', str(error))}")
    return ValueError(_PROMPT_INDEX.sub(lambda match: f"the prompt on {chunk[int(match[1])].where}", str(error)))


def generate_in_chunks(
    rollout: Any,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    chunk: int,
    on_progress: Progress | None = None,
    generation_options: dict[str, Any] | None = None,
    results: list[Any] | None = None,
) -> list[Any]:
    """One `rollout.generate` per `chunk` prompts (input order), each with `generation_options` as its
    overrides; `on_progress` after each. Each chunk gets its prompts' stream keys and budgets from the whole
    file's (`subset_sampling`), so a sampled prompt draws what one call over every prompt would draw for
    it, whatever the chunk size (per-sequence logits processors see one prompt's ids only). Each chunk's
    result is appended to `results` (a new list if None) as it returns, so a caller interrupted midway
    holds the finished ones."""
    from autobucket.engine.sampling.streams import subset_sampling

    results = [] if results is None else results
    if on_progress is not None:
        on_progress(0, len(prompts))
    for start in range(0, len(prompts), chunk):
        indices = range(start, min(start + chunk, len(prompts)))
        chunk_sampling = subset_sampling(sampling, indices, len(prompts))
        results.append(rollout.generate(prompts[start : start + chunk], chunk_sampling, **(generation_options or {})))
        if on_progress is not None:
            on_progress(min(start + chunk, len(prompts)), len(prompts))
    return results


def record_sampling(sampling: SamplingConfig, records: Sequence[PromptRecord]) -> SamplingConfig:
    """The job's sampling with each line's own "max_new_tokens" in place of the job's budget for it."""
    if all(record.max_new_tokens is None for record in records):
        return sampling
    job_budgets = sampling.request_budgets(len(records))
    budgets = [r.max_new_tokens or job for r, job in zip(records, job_budgets, strict=True)]
    return dataclasses.replace(sampling, max_new_tokens=budgets)


def summarize(
    job: GenerateJob,
    prompts: Sequence[list[int]],
    results: Sequence[Any],
    samples: Sequence[list[Sample]],
    load_s: float,
    generate_s: float,
) -> dict[str, Any]:
    """What ran and what it cost, summed over the chunks (`samples`: per prompt, as written)."""
    profiles = [result.profile for result in results]
    output_tokens = sum(p.output_tokens for p in profiles)
    reasons = Counter(sample.finish_reason for prompt_rows in samples for sample in prompt_rows)
    return {
        "model": job.model,
        "prompts": len(prompts),
        "route": job.rollout.route,
        "routes_run": dict(Counter(result.route for result in results)),
        "bucket_widths": [_first_admission_widths(p, prompts, start) for p, start in _chunk_starts(results)],
        "prefill_forwards": sum(p.prefill_forwards for p in profiles),
        "decode_forwards": sum(p.decode_forwards for p in profiles),
        "prompt_tokens": sum(len(p) for p in prompts),
        "prefill_tokens": sum(p.prefill_tokens for p in profiles),
        "cached_prompt_tokens": sum(p.cached_prompt_tokens for p in profiles),
        "output_tokens": output_tokens,
        "finish_reasons": dict(reasons),
        "load_s": load_s,
        "generate_s": generate_s,
        "tokens_per_s": output_tokens / max(generate_s, 1e-9),
        "costs_source": profiles[-1].costs_source if profiles else "",
        "plan": profiles[-1].plan if profiles else {},
        "predicted_ms": sum(p.predicted_ms or 0.0 for p in profiles) if any(p.predicted_ms for p in profiles) else None,
        "measured_ms": sum(p.measured_ms for p in profiles),
        "out": job.out,
    }


def _chunk_starts(results: Sequence[Any]) -> list[tuple[Any, int]]:
    starts, start = [], 0
    for result in results:
        starts.append((result.profile, start))
        start += len(result.tokens)
    return starts


def _first_admission_widths(profile: Any, prompts: Sequence[list[int]], start: int) -> list[int]:
    """Padded width of each prefill group of a chunk's first admission (empty for plain ordinary)."""
    if not profile.prefill_groups:
        return []
    return [max(len(prompts[start + i]) for i in group) for group in profile.prefill_groups[0]]
