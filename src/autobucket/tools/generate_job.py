"""`autobucket generate` as library functions: a prompts file -> token ids -> `Rollout` -> JSONL.

The input is parsed and checked completely before the model loads, so a bad line fails at once and
names its line number. The output is written to a temporary file and renamed only after every prompt
has finished, so a failed run never leaves a partial output file. Prompts run in chunks of a few
continuous batches (one `generate` call each) only so that progress can be reported; tokens do not
depend on the chunking: every route is exact per request, and each chunk passes its prompts the stream
keys one call over the whole file would give them, so sampled tokens are the same too."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autobucket.checks import optional_int, require_bool, require_int
from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.prompts import conversation_ids, is_conversation, message_problem
from autobucket.tools.generate_output import (
    STDIO,
    Sample,
    check_output_path,
    output_rows,
    prompt_samples,
    write_jsonl,
)

INPUT_FORMATS = ("auto", "jsonl", "txt")
CHUNK_BATCHES = 4  # continuous batches per generate call: progress granularity for long runs

Progress = Callable[[int, int], None]  # (finished prompts, all prompts)


@dataclass(frozen=True)
class PromptRecord:
    """One input prompt: text, token ids or chat messages, and where it came from."""

    id: Any  # the line's "id", else the prompt's 0-based position
    line: int  # 1-based line number in the input
    text: str | None = None
    ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # a conversation, through the tokenizer's chat template
    max_new_tokens: int | None = None  # the line's own budget (None: the job's)


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
            raise ValueError(f"generation_options={self.generation_options!r} is invalid: expected a dict of "
                             "GenerationConfig field names to values")  # fmt: skip


# ------------------------------------------------------------------ input
def read_prompts(source: str | Path, input_format: str = "auto") -> list[PromptRecord]:
    """Prompt records from a JSONL or text file ("-": stdin); errors name the line."""
    name = "<stdin>" if str(source) == STDIO else str(source)
    if str(source) == STDIO:
        lines = sys.stdin.read().splitlines()
    else:
        try:
            lines = Path(source).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read prompts from {name!r}: {exc}") from exc
    return parse_prompt_lines(lines, _input_format(name, lines, input_format), name)


def _input_format(name: str, lines: Sequence[str], input_format: str) -> str:
    """"auto": by suffix (.jsonl/.json, .txt), else JSONL when the first non-blank line is an object."""
    if input_format != "auto":
        return input_format
    suffix = Path(name).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix == ".txt":
        return "txt"
    first = next((line for line in lines if line.strip()), "")
    return "jsonl" if first.lstrip().startswith("{") else "txt"


def parse_prompt_lines(lines: Iterable[str], input_format: str, name: str = "<prompts>") -> list[PromptRecord]:
    """JSONL: one object per line with "prompt" (text), "prompt_ids" (token ids) or "messages" (a chat
    conversation, [{"role": ..., "content": ...}, ...]), optional "id" and "max_new_tokens" (that prompt's
    budget, in place of the job's).
    txt: one text prompt per line. Blank lines are skipped in both."""
    records: list[PromptRecord] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if input_format == "txt":
            records.append(PromptRecord(id=len(records), line=number, text=line))
        else:
            records.append(_jsonl_record(line, number, len(records), name))
    if not records:
        raise ValueError(f"{name} holds no prompts: give one prompt per line")
    return records


def _jsonl_record(line: str, number: int, position: int, name: str) -> PromptRecord:
    where = f"{name}:{number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f'{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be an object like '
            '{"prompt": "..."}, {"prompt_ids": [1, 2, 3]} or {"messages": [{"role": "user", "content": "..."}]}'
        ) from None
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object with \"prompt\", \"prompt_ids\" or \"messages\", got "
                         f"{type(item).__name__}")  # fmt: skip
    if sum(field in item for field in ("prompt", "prompt_ids", "messages")) != 1:
        raise ValueError(f'{where}: give exactly one of "prompt" (text), "prompt_ids" (token ids) or "messages" '
                         "(a chat conversation)")  # fmt: skip
    record_id = item.get("id", position)
    budget = item.get("max_new_tokens")
    if budget is not None and not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1):
        raise ValueError(f'{where}: "max_new_tokens" must be an int >= 1 (this prompt\'s budget), got {budget!r}')
    if "messages" in item:
        messages = item["messages"]
        if not is_conversation(messages) or message_problem(messages) is not None:
            raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}} '
                             f"objects, got {messages!r}")  # fmt: skip
        return PromptRecord(id=record_id, line=number, messages=messages, max_new_tokens=budget)
    if "prompt" in item:
        text = item["prompt"]
        if not isinstance(text, str) or not text:
            raise ValueError(f'{where}: "prompt" must be a non-empty string, got {text!r}')
        return PromptRecord(id=record_id, line=number, text=text, max_new_tokens=budget)
    ids = item["prompt_ids"]
    if not isinstance(ids, list) or not ids or not all(_is_token_id(token) for token in ids):
        raise ValueError(f'{where}: "prompt_ids" must be a non-empty list of token ids (ints >= 0), got {ids!r}')
    return PromptRecord(id=record_id, line=number, ids=ids, max_new_tokens=budget)


def _is_token_id(value: Any) -> bool:
    try:
        require_int("token id", value, minimum=0)
    except ValueError:
        return False
    return True


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
                    f"line {record.line}: --chat applies to text prompts but this line gives prompt_ids; "
                    "drop --chat or give the text as \"prompt\""
                )
            ids = record.ids
        elif tokenizer is None:
            kind = "chat messages" if record.messages is not None else "a text prompt"
            raise ValueError(
                f"line {record.line}: {kind}, but {model_name} has no tokenizer: give token ids as "
                '{"prompt_ids": [...]}'
            )
        elif record.messages is not None:  # templated whether or not --chat is given
            ids = conversation_ids(tokenizer, record.messages, f"line {record.line}")
        else:
            assert record.text is not None, "read_prompts gives every record its ids or its text"
            ids = chat_prompt_ids(tokenizer, record.text) if chat else tokenizer(record.text)["input_ids"]
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"line {record.line}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        encoded.append(list(ids))
    return encoded


# ------------------------------------------------------------------ run
def run_generate_job(job: GenerateJob, on_progress: Progress | None = None) -> dict[str, Any]:
    """Read, generate, write; returns the summary (route, buckets, times, tokens/s)."""
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
    chunk = job.chunk_prompts or CHUNK_BATCHES * job.sampling.continuous_batch_size
    started = time.perf_counter()
    results = generate_in_chunks(rollout, prompts, record_sampling(job.sampling, records), chunk, on_progress,
                                 job.generation_options)  # fmt: skip
    generate_s = time.perf_counter() - started
    samples = prompt_samples(results, job.sampling.n)
    write_jsonl(output_rows(records, samples, tokenizer), job.out)
    return summarize(job, prompts, results, samples, load_s, generate_s)


def generate_in_chunks(
    rollout: Any, prompts: list[list[int]], sampling: SamplingConfig, chunk: int, on_progress: Progress | None = None,
    generation_options: dict[str, Any] | None = None,
) -> list[Any]:  # fmt: skip
    """One `rollout.generate` per `chunk` prompts (input order), each with `generation_options` as its
    overrides; `on_progress` after each. Each chunk gets its prompts' stream keys and budgets from the whole
    file's (`subset_sampling`), so a sampled prompt draws what one call over every prompt would draw for
    it, whatever the chunk size (per-sequence logits processors see one prompt's ids only)."""
    from autobucket.engine.sampling.streams import subset_sampling

    results = []
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
