"""Rich output shared by the commands that run long measurements (calibrate, sweep)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def progress_bar(total: int, description: str) -> Iterator[Callable[[str], None]]:
    """A rich progress bar; yields ``step(description)``, to call after each finished item."""
    columns = (TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        task = progress.add_task(description, total=total)
        yield lambda done: progress.update(task, advance=1, description=done)


