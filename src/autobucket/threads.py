"""Torch CPU threads: set them, and warn when there are more than this process can run at once.

On a small CPU machine the thread count matters more than anything else: torch starts one thread per
core it sees, and when those cores are busy (or the process is pinned to fewer of them, e.g. with
`taskset`) its threads wait on each other at every parallel region, and two threads on one free core
can run several times slower than one. Only the case that can
be seen from inside the process is detected: more torch threads than CPUs in this process's affinity
mask (`os.sched_getaffinity`). Other jobs on the same cores are not visible here; docs/troubleshooting.md
says what to do about them."""

from __future__ import annotations

import os

from autobucket.checks import optional_int, warn_once


class ThreadOversubscriptionWarning(RuntimeWarning):
    """torch uses more CPU threads than the cores this process may run on."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; the CPU count where there is no mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity mask
        return os.cpu_count() or 1


def oversubscription_message(threads: int, cpus: int) -> str | None:
    """One line saying what is wrong and the fix, or None when `threads` fit on `cpus`."""
    if threads <= cpus:
        return None
    return (
        f"torch uses {threads} CPU threads but this process may run on {cpus} CPU(s); each forward waits on "
        f"threads that cannot run: set_torch_threads({cpus}) (CLI: --threads {cpus})"
    )


def warn_if_oversubscribed() -> None:
    """Warn, once per process and thread count, when torch has more threads than this process's CPUs."""
    import torch

    message = oversubscription_message(torch.get_num_threads(), usable_cpus())
    if message is not None:
        warn_once(message, ThreadOversubscriptionWarning, stacklevel=3)  # at the caller of this function


def set_torch_threads(threads: int | None) -> int:
    """`torch.set_num_threads(threads)` (None keeps torch's choice), then the oversubscription check;
    returns the thread count in use. Use 1 on a machine shared with other CPU-bound jobs."""
    import torch

    threads = optional_int("threads", threads, fix="pass a positive number of torch CPU threads, or None")
    if threads is not None:
        torch.set_num_threads(threads)
    warn_if_oversubscribed()
    return torch.get_num_threads()
