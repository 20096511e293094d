"""Counts in words for the commands' messages: "1 prompt", "3 prompts"."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """`count` and `noun`, plural unless the count is one (`plural` for an irregular one)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
