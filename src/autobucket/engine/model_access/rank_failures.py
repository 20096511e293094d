"""One rank's refusal, raised on every rank, before any rank starts the collectives of a call.

Ranks of a sharded model generate together (their weight gathering is a collective). If one rank's
call stops early on bad input and the others go on, they wait on an all-gather that rank never joins:
a hang until the process group's timeout, with no reason given. So the checks of a sharded call run
inside `failures_shared`: at its end every rank exchanges its outcome (one `all_gather_object` of
None or the error's text over the default process group), and if any rank failed, every rank raises:
the failing rank its own exception unchanged, the others a RuntimeError naming that rank and its
reason. Every rank of the default process group must make the call, as accelerate's and TRL's
trainers do."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def failures_shared(active: bool) -> Iterator[None]:
    """Around the checks of a call; `active`: the call is sharded over an initialised process group."""
    if not active:
        yield
        return
    try:
        yield
    except Exception as error:
        _exchange(f"{type(error).__name__}: {error}")
        raise
    failed = _exchange(None)
    if failed:
        rank, reason = failed[0]
        raise RuntimeError(
            f"rank {rank} refused its generate call ({reason}); every rank raises it rather than wait on "
            f"a collective that rank would not join: fix rank {rank}'s input and call again"
        )


def _exchange(reason: str | None) -> list[tuple[int, str]]:
    """(rank, reason) of every other rank that failed; every rank must call it once per check."""
    import torch.distributed as dist

    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    me = dist.get_rank()
    return [(rank, text) for rank, text in enumerate(reasons) if text is not None and rank != me]


def distributed_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
