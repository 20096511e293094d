"""The ``autobucket`` command line: one module per command, shared argument types in ``args``."""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from autobucket.cli.main import main as run

    return run(argv)
