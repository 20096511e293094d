"""The prompts file of `autobucket generate`: JSONL or text lines -> `PromptRecord`s, each naming its line.

Lines end at "\n" (or "\r\n") only, never at the other characters `str.splitlines` takes for line ends
(U+2028, U+2029, U+0085, form feed, ...): JSON writes those unescaped inside strings
(`json.dumps(ensure_ascii=False)`, as `generate --out` writes), and in a text prompt they are text.
Every error names the line as `FILE:LINE:` (1-based), as compilers do."""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autobucket.checks import require_int
from autobucket.prompts import is_conversation, message_problem

STDIO = "-"  # = generate_output.STDIO: stdin for the prompts
PROMPT_KEYS = ("prompt", "prompt_ids", "messages")  # exactly one per JSONL line
OPTIONAL_KEYS = ("id", "max_new_tokens")
_OBJECT_EXAMPLES = '{"prompt": "..."}, {"prompt_ids": [1, 2, 3]} or {"messages": [{"role": "user", "content": "..."}]}'


@dataclass(frozen=True)
class PromptRecord:
    """One input prompt: text, token ids or chat messages, and where it came from."""

    id: Any  # the line's "id", else the prompt's 0-based position
    line: int  # 1-based line number in the input
    text: str | None = None
    ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # a conversation, through the tokenizer's chat template
    max_new_tokens: int | None = None  # the line's own budget (None: the job's)
    source: str = "<prompts>"  # the file's name as the user gave it ("<stdin>" for -)

    @property
    def where(self) -> str:
        """``"prompts.jsonl:3"``: the line, as every message about it starts."""
        return f"{self.source}:{self.line}"


def read_prompts(source: str | Path, input_format: str = "auto") -> list[PromptRecord]:
    """Prompt records from a JSONL or text file ("-": stdin); errors name the line."""
    name = "<stdin>" if str(source) == STDIO else str(source)
    try:
        text = _read_stdin() if str(source) == STDIO else _read_file(Path(source))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read prompts from {name!r}: {exc}") from exc
    lines = split_lines(text)
    return parse_prompt_lines(lines, _input_format(name, lines, input_format), name)


def split_lines(text: str) -> list[str]:
    """`text`'s lines, ended by "\n" or "\r\n" only (a last line without an end counts)."""
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    return lines[:-1] if lines[-1] == "" else lines


def _read_file(path: Path) -> str:
    with path.open(encoding="utf-8", newline="") as stream:  # newline="": keep "\r", split here
        return stream.read()


def _read_stdin() -> str:
    stream = getattr(sys.stdin, "buffer", None)  # bytes: the text layer would end lines at a lone "\r"
    return sys.stdin.read() if stream is None else stream.read().decode("utf-8")


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
    budget, in place of the job's); any other key is refused.
    txt: one text prompt per line. Blank lines are skipped in both."""
    records: list[PromptRecord] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if input_format == "txt":
            records.append(PromptRecord(id=len(records), line=number, text=line, source=name))
        else:
            records.append(_jsonl_record(line, number, len(records), name))
    if not records:
        raise ValueError(f"{name} holds no prompts: give one prompt per line")
    return records


def _jsonl_record(line: str, number: int, position: int, name: str) -> PromptRecord:
    where = f"{name}:{number}"
    item = _json_object(line, where)
    budget = item.get("max_new_tokens")
    if budget is not None and not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1):
        raise ValueError(f'{where}: "max_new_tokens" must be an int >= 1 (this prompt\'s budget), got {budget!r}')
    fields = {"id": item.get("id", position), "line": number, "max_new_tokens": budget, "source": name}
    if "messages" in item:
        messages = item["messages"]
        if not is_conversation(messages) or message_problem(messages) is not None:
            raise ValueError(
                f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}} '
                f"objects, got {messages!r}"
            )
        return PromptRecord(messages=messages, **fields)
    if "prompt" in item:
        text = item["prompt"]
        if not isinstance(text, str) or not text:
            raise ValueError(f'{where}: "prompt" must be a non-empty string, got {text!r}')
        return PromptRecord(text=text, **fields)
    ids = item["prompt_ids"]
    if not isinstance(ids, list) or not ids or not all(_is_token_id(token) for token in ids):
        raise ValueError(f'{where}: "prompt_ids" must be a non-empty list of token ids (ints >= 0), got {ids!r}')
    return PromptRecord(ids=ids, **fields)


def _json_object(line: str, where: str) -> dict[str, Any]:
    """The line's object, with one of PROMPT_KEYS. A key outside PROMPT_KEYS + OPTIONAL_KEYS that looks like
    one of them is a misspelling and refused; others are a data set's own fields (an answer, a label), and
    ignored."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be an object like "
            f"{_OBJECT_EXAMPLES}"
        ) from None
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object like {_OBJECT_EXAMPLES}, got {type(item).__name__}")
    misspelt = [key for key in item if key not in PROMPT_KEYS + OPTIONAL_KEYS and _close_key(key)]
    if misspelt:
        raise ValueError(f"{where}: {_unknown_key_text(misspelt[0])}")
    if sum(key in item for key in PROMPT_KEYS) != 1:
        raise ValueError(
            f'{where}: give exactly one of "prompt" (text), "prompt_ids" (token ids) or "messages" '
            "(a chat conversation)"
        )
    return item


def _close_key(key: str) -> str | None:
    close = difflib.get_close_matches(key, PROMPT_KEYS + OPTIONAL_KEYS, n=1)
    return close[0] if close else None


def _unknown_key_text(key: str) -> str:
    return (
        f"unknown key {json.dumps(key)}: did you mean {json.dumps(_close_key(key))}? (a line takes one of "
        f"{', '.join(json.dumps(k) for k in PROMPT_KEYS)} and optionally "
        f"{', '.join(json.dumps(k) for k in OPTIONAL_KEYS)}; keys unlike these are ignored)"
    )


def _is_token_id(value: Any) -> bool:
    try:
        require_int("token id", value, minimum=0)
    except ValueError:
        return False
    return True
