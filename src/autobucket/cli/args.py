"""Argument types and helpers shared by the subcommands: one definition of each flag that several
commands take (`--model` and its loading options, `--threads`), hidden aliases for renamed flags, and
the translation of library error text into the command's own flags."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ONLINE_COSTS = "online"  # RolloutConfig.costs's word for "learn them" (costs.source.ONLINE)
_LENGTH_ITEM = re.compile(r"(\d+)(?:[xX](\d+))?", re.ASCII)
# the library's advice on a calibration file of another setup; each command's words for it are its flag
OVERRIDE_PHRASE = "pass RolloutConfig(costs_strict=False) / load_calibration(strict=False) / --allow-mismatch"
MODEL_HELP = (
    "a model folder, a Hugging Face id in the local cache, smollm2 (the embedded SmolLM2-135M-Instruct), "
    "a tiny-*/bench-qwen2 name (random weights), or an HF config.json path (random weights)"
)


def parse_lengths(text: str) -> list[int]:
    """``"512,16x31"`` -> one 512-token prompt then 31 prompts of 16 tokens."""
    lengths: list[int] = []
    for item in text.split(","):
        match = _LENGTH_ITEM.fullmatch(item.strip())
        if match is None or int(match[1]) < 1 or (match[2] is not None and int(match[2]) < 1):
            raise argparse.ArgumentTypeError(
                f"bad --lengths item {item.strip()!r}: expected L or LxN with positive integers, "
                "e.g. 512,16x31 (one prompt of 512 tokens and 31 of 16)"
            )
        lengths += [int(match[1])] * (1 if match[2] is None else int(match[2]))
    return lengths


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _int_at_least(text: str, minimum: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def seed_argument(text: str) -> int:
    """--seed: an int in [0, 2**64), the range of the library's stream keys."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {text!r}")
    return value


def token_ids_argument(text: str) -> list[int]:
    """--suppress-tokens / --bad-words-ids: comma-separated token ids ("17,42")."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        ids = [-1]
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids >= 0 (e.g. 17,42), got {text!r}")
    return ids


def generation_option_argument(text: str) -> tuple[str, Any]:
    """--generation-option: KEY=VALUE, VALUE as JSON (a bare word that is not JSON is taken as a string)."""
    key, equals, raw = text.partition("=")
    if not equals or not key.isidentifier():
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE with a GenerationConfig field as KEY (e.g. no_repeat_ngram_size=3), got {text!r}"
        )
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def costs_argument(text: str) -> str | Path:
    """--costs: "online" (Auto learns from its own calls) or a calibration / coefficients JSON path."""
    return ONLINE_COSTS if text == ONLINE_COSTS else Path(text)


def non_negative_float(text: str) -> float:
    from autobucket.checks import require_finite

    try:
        return require_finite("value", float(text), minimum=0.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}") from None


# ---------------------------------------------------------------- model and threads
def add_model_arguments(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """--model and how to load it (--dtype, --device, --attn-implementation, --trust-remote-code),
    plus --threads: the same flags and accepted forms on every command that loads a model."""
    parser.add_argument(
        "--model",
        required=default is None,
        default=default,
        help=MODEL_HELP + (f" (default: {default})" if default else ""),
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the model's weights and activations (default: float32)",
    )
    parser.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    parser.add_argument(
        "--attn-implementation",
        default="sdpa",
        choices=("sdpa", "eager"),
        help="transformers' attention: sdpa (default) or eager",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model repo's own code")
    add_threads_argument(parser)


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help="torch CPU threads (default: torch's, one per usable core); 1 is far faster on a machine "
        "shared with other CPU-bound jobs",
    )


def apply_threads(args: argparse.Namespace) -> int:
    """Set torch's CPU threads from --threads and warn when they exceed the usable cores."""
    from autobucket.threads import set_torch_threads

    return set_torch_threads(args.threads)


def model_device(args: argparse.Namespace) -> str:
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def load_model_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(model, tokenizer) from `add_model_arguments`' flags: `autobucket.load_model` takes them by name."""
    from autobucket.models import load_model

    return load_model(**model_arguments(args))


def model_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The `--model` group's flags as `autobucket.load_model`'s keywords (same names)."""
    return {"model": args.model, "dtype": args.dtype, "device": model_device(args),
            "attn_implementation": args.attn_implementation, "trust_remote_code": args.trust_remote_code,
            "threads": args.threads}  # fmt: skip


# ---------------------------------------------------------------- renamed flags and error wording
class _DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: hidden from --help, same destination, a one-line notice when used."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str = "", **kwargs: Any) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        print(
            f"{parser.prog}: {option_string} is deprecated and will be removed: use {self.replacement}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_alias(container: Any, old: str, new: str, dest: str, **kwargs: Any) -> None:
    """Keep `old` working for one release as a hidden alias of `new` (same `dest`)."""
    container.add_argument(
        old,
        dest=dest,
        action=_DeprecatedAlias,
        replacement=new,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        **kwargs,
    )


def finish_parser(
    parser: argparse.ArgumentParser, handler: Callable[[argparse.Namespace], int], phrases: dict[str, str] | None = None
) -> None:
    """Register the handler and this command's words: each visible flag's destination -> the flag, so
    library errors ("prefill_max_tokens=...") reach the user as the flag they typed."""
    words = dict(phrases or {})
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of a parser's actions
        longs = [option for option in action.option_strings if option.startswith("--")]
        if longs and action.help != argparse.SUPPRESS and action.dest not in words:
            words[action.dest] = longs[0]
    parser.set_defaults(handler=handler, cli_words=words)


def in_cli_words(message: str, words: dict[str, str]) -> str:
    """Library error text in the command's words: phrases first, then `name=value` -> `--flag value`,
    then bare multi-word names (`prefill_max_tokens` -> `--prefill-max-tokens`). A name in double quotes
    is a key of the user's JSON (a prompts line's "max_new_tokens"), not the flag: it stays."""
    for api, cli in words.items():
        if " " in api:
            message = message.replace(api, cli)
    for api, cli in words.items():
        if " " in api:
            continue
        message = re.sub(rf'(?<![\w"-]){re.escape(api)}=', f"{cli} ", message)
        if "_" in api:
            message = re.sub(rf'(?<![\w"-]){re.escape(api)}(?![\w"])', cli, message)
    return message
