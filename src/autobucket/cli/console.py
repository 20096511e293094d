"""Rich output shared by the commands: the console a report prints on, and the progress bar of the
commands that run long measurements (calibrate, sweep)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

LOG_WIDTH = 160  # columns of a report written to a pipe or a log file


def report_console() -> Console:
    """Stdout as rich sees it: a terminal's own width; in a pipe or a file, $COLUMNS where set, else
    LOG_WIDTH (rich's 80 there would wrap a wide table that nobody has to read in 80 columns)."""
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = LOG_WIDTH
    return console


@contextmanager
def progress_bar(total: int, description: str) -> Iterator[Callable[[str], None]]:
    """A rich progress bar; yields ``step(description)``, to call after each finished item."""
    columns = (TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        task = progress.add_task(description, total=total)
        yield lambda done: progress.update(task, advance=1, description=done)
