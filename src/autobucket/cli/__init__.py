"""The ``autobucket`` command line: one module per command, shared argument helpers in ``args``."""

from __future__ import annotations

# Imported eagerly: a lazy import of the submodule `autobucket.cli.main` would rebind the package
# attribute `main` to that module, so a later `from autobucket.cli import main` got a module.
from autobucket.cli.main import main

__all__ = ["main"]
