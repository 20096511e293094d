"""Argument types and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import re

_LENGTH_ITEM = re.compile(r"(\d+)(?:[xX](\d+))?", re.ASCII)


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
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
