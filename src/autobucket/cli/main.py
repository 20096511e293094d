"""The ``autobucket`` command line.

Each command is one module with ``add_parser(subparsers)``, which registers its arguments and handler; a
handler turns the parsed arguments into library inputs, calls one library function and prints the result.
Decisions live in the library, never here. Torch is imported inside handlers only, so ``plan`` and
``--help`` stay fast. Usage errors exit with status 2, like argparse's own; Ctrl-C exits with 130 (128 +
SIGINT, what a shell reports for a command it stopped) after one line, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from autobucket import __version__
from autobucket.cli import calibrate, demo, generate, plan, serve, sweep
from autobucket.cli.args import in_cli_words

_USAGE_ERROR = 2
_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a usage error: return the status instead of exiting
        return exc.code if isinstance(exc.code, int) else _USAGE_ERROR
    prefix = f"autobucket {args.command}"
    with warnings.catch_warnings():
        # A warning is one line on stderr, in the command's words (the library's warnings.warn shows the
        # source line too, which tells a CLI user nothing).
        warnings.showwarning = lambda message, *_: print(
            f"{prefix}: warning: {in_cli_words(str(message), args.cli_words)}", file=sys.stderr
        )
        try:
            return args.handler(args)
        except ValueError as exc:
            print(f"{prefix}: error: {in_cli_words(str(exc), args.cli_words)}", file=sys.stderr)
            return _USAGE_ERROR
        except KeyboardInterrupt as exc:  # a handler that saved its finished work says so in its text
            print(f"{prefix}: {str(exc) or 'interrupted'}", file=sys.stderr)
            return _INTERRUPTED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autobucket", description="Fast batched generation for Hugging Face causal LMs."
    )
    parser.add_argument(
        "--version", action="version", version=f"autobucket {__version__}", help="print the version and exit"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (plan, generate, demo, calibrate, sweep, serve):
        command.add_parser(subparsers)
    return parser
