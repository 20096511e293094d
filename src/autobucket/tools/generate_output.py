"""What `autobucket generate` writes: one JSON object per prompt and sample, all the given rows or none.

The rows are written to a temporary file in the target's folder and renamed over it (`tempfile` +
`os.replace`), so a failed write never leaves a partial output file."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

STDIO = "-"


class InputPrompt(Protocol):
    """What a row needs of its input line (prompt_file's `PromptRecord`)."""

    @property
    def id(self) -> Any: ...
    @property
    def text(self) -> str | None: ...
    @property
    def ids(self) -> list[int] | None: ...
    @property
    def messages(self) -> list[dict[str, Any]] | None: ...


@dataclass(frozen=True)
class Sample:
    """One generated sequence of one prompt."""

    tokens: list[int]
    finish_reason: str
    logprobs: list[float] | None  # with SamplingConfig(logprobs=True)


def prompt_samples(results: Sequence[Any], n: int) -> list[list[Sample]]:
    """Per prompt (input order, over the chunks' results), its n samples."""

    def per_sample(entry: Any) -> list[Any]:  # with n = 1 a result holds each prompt's one sequence itself
        return entry if n > 1 else [entry]

    per_prompt = []
    for result in results:
        logprobs = result.logprobs if result.logprobs is not None else [None] * len(result.tokens)
        for tokens, reasons, logps in zip(result.tokens, result.finish_reasons, logprobs, strict=True):
            sample_logps = [None] * n if logps is None else per_sample(logps)
            entries = zip(per_sample(tokens), per_sample(reasons), sample_logps, strict=True)
            per_prompt.append([Sample(*entry) for entry in entries])
    return per_prompt


def output_rows(records: Sequence[InputPrompt], samples: Sequence[list[Sample]], tokenizer: Any) -> list[dict[str, Any]]:
    """One JSON object per prompt and sample, prompt-major: id, "sample" (its index, when there are
    several), prompt (text; the messages of a conversation; decoded ids; else null), completion, tokens, finish_reason, and "logprobs"
    when they were asked for."""
    rows = []
    for record, prompt_rows in zip(records, samples, strict=True):
        prompt: Any = record.text if record.text is not None else record.messages  # a conversation as given
        if prompt is None and tokenizer is not None:
            prompt = tokenizer.decode(record.ids)
        for index, sample in enumerate(prompt_rows):
            row: dict[str, Any] = {"id": record.id}
            if len(prompt_rows) > 1:
                row["sample"] = index
            completion = None if tokenizer is None else tokenizer.decode(sample.tokens, skip_special_tokens=True)
            row.update(prompt=prompt, completion=completion, tokens=sample.tokens, finish_reason=sample.finish_reason)
            if sample.logprobs is not None:
                row["logprobs"] = sample.logprobs
            rows.append(row)
    return rows


def check_output_path(out: str, prompts: str = STDIO) -> None:
    """Refuse, before any work, an --out that cannot be written or that is the --prompts file itself
    (written over, the prompts would be gone)."""
    if out == STDIO:
        return
    if prompts != STDIO and Path(out).resolve() == Path(prompts).resolve():
        raise ValueError(f"--out {out!r} is the --prompts file: writing it would replace the prompts; name another file")
    folder = Path(out).resolve().parent
    if not folder.is_dir():
        raise ValueError(f"cannot write --out {out!r}: the folder {str(folder)!r} does not exist")
    if Path(out).is_dir():
        raise ValueError(f"cannot write --out {out!r}: it is a folder; name a .jsonl file")


def write_jsonl(rows: Iterable[dict[str, Any]], out: str) -> None:
    """All rows, or nothing: a temporary file in the target's folder renamed over it ("-": stdout)."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if out == STDIO:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = Path(out)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.resolve().parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
