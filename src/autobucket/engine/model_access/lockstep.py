"""Lockstep: every rank runs its sharded model's forwards together, each keeping only its shards.

Why: a sharded forward all-gathers each layer's shards (FSDP2's pre-forward hooks), a collective every
rank must join, while the engine runs a data-dependent number of forwards per rank (its own prompts, its
own stopping, its own route). Under `RolloutConfig(sharded_weights="lockstep")` every forward of the
called module on the call's thread is preceded by one all-reduce (a sum) over the default process group
of two integers: [this rank runs a forward, this rank failed]. A rank whose work is over (or which had
none) keeps answering [0, 0] and, whenever the sum says another rank still runs a forward, runs a
one-token forward whose output is discarded: its layers' all-gathers pair with that rank's. When the
sum's first entry is 0 every rank is done, all at the same exchange, and all leave together.

Every forward of the model goes through the same FSDP groups in the same order whatever its shape
(prefill, a decode step, the one-token forward), so pairing forwards one to one pairs their collectives.
The protocol sits at the model's forward, not in a route: ranks may take different routes (route="auto"
decides per rank), HF `generate` included. HF's own lockstep (`synced_gpus`) stays off there: its
all-reduce per step is a collective the other routes do not make.

A failure on one rank between forwards (a stopping criterion, a logits processor, a forward hook of
its own) is raised there; that rank sends [0, 1], every rank sees it at the same exchange and stops,
and all then share the reason (`rank_failures`): the failing rank raises its own exception, the others
a RuntimeError naming it. A failure inside a forward after some of its collectives ran (out of memory
in a layer) cannot be paired: the other ranks wait until the process group's timeout, as they would on
the trainer's own forward.

Cost per forward: one all-reduce of two integers, on top of the forward's own all-gathers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from autobucket.engine.model_access.rank_failures import failures_shared


class PeerFailed(RuntimeError):
    """Raised from a rank's forward when another rank reported a failure at the same exchange."""


class LockstepProtocol:
    """One call's exchanges on this rank: `before_forward` for each of its forwards, `drain` at its end."""

    def __init__(self, dummy_forward: Callable[[], None], device: torch.device) -> None:
        self._dummy_forward = dummy_forward
        self._device = device
        self._thread = threading.get_ident()  # other threads' forwards of the model are not the call's
        self._draining = False
        self.stopped_by_peer = False  # a peer's failure was seen before this rank's work was over
        self.forwards = 0  # exchanges at which this rank ran its own forward
        self.dummy_forwards = 0  # one-token forwards run to pair with a peer's
        self.exchanges = 0

    def before_forward(self, module: torch.nn.Module, args: tuple) -> None:
        """A forward pre-hook on the called module: announce this rank's forward, learn of failures."""
        if self._draining or threading.get_ident() != self._thread:
            return
        _, failed = self._exchange(working=1, failed=0)
        if failed:
            self.stopped_by_peer = True
            raise PeerFailed("another rank failed during the lockstep call; every rank stops at this forward")
        self.forwards += 1

    def drain(self, failed_here: bool) -> bool:
        """One-token forwards paired with the peers' until no rank runs one; whether any rank failed.
        A rank that saw a peer's failure in `before_forward` has stopped with everyone: it drains nothing."""
        if self.stopped_by_peer:
            return True
        self._draining = True
        while True:
            working, failed = self._exchange(working=0, failed=int(failed_here))
            if failed:
                return True
            if not working:
                return False
            self._dummy_forward()
            self.dummy_forwards += 1

    def _exchange(self, working: int, failed: int) -> tuple[int, int]:
        import torch.distributed as dist

        flags = torch.tensor([working, failed], dtype=torch.int64, device=self._device)
        dist.all_reduce(flags)  # sum over every rank of the default process group
        self.exchanges += 1
        return int(flags[0]), int(flags[1])


@contextmanager
def lockstep_forwards(called: torch.nn.Module, dummy_forward: Callable[[], None]) -> Iterator[LockstepProtocol]:
    """Inside: every forward of `called` on this thread paired across ranks; at the end, one-token forwards
    (`dummy_forward`) until every rank is done. Every rank of the default process group must enter it
    (a rank with no prompts too). A failure on any rank raises on every rank, after all stopped."""
    protocol = LockstepProtocol(dummy_forward, _exchange_device(called))
    # first among the pre-hooks: the exchange comes before FSDP's all-gathers of the forward
    handle = called.register_forward_pre_hook(protocol.before_forward, prepend=True)
    error: Exception | None = None
    try:
        yield protocol
    except Exception as raised:  # noqa: BLE001 - shared with every rank below, then raised again
        error = raised
    finally:
        handle.remove()
    if protocol.drain(failed_here=error is not None and not protocol.stopped_by_peer):
        _share_failure(None if protocol.stopped_by_peer else error)
    if error is not None:  # unreachable: a failure reached every rank's exchange and was raised above
        raise error


def _share_failure(error: Exception | None) -> None:
    """Every rank exchanges its reason; the failing rank raises its own exception, the others a
    RuntimeError naming the failing rank (`failures_shared`)."""
    with failures_shared(active=True):
        if error is not None:
            raise error
    raise AssertionError("a rank reported a failure at the lockstep exchange but gave no reason")


def _exchange_device(model: torch.nn.Module) -> torch.device:
    """Where the flags live: the model's device (NCCL takes CUDA tensors only; gloo takes CPU ones)."""
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")
