"""Full weights for one rollout call on a DeepSpeed ZeRO-3 engine, with no collectives inside the call.

ZeRO-3's module hooks all-gather a submodule's partitioned parameters before its forward and release
them after, so ranks running different numbers of forwards (their own prompts, their own stopping)
fall out of step. As DeepSpeed's hybrid engine and TRL's `ds3_gather_for_generation` do, every
parameter is gathered once (`deepspeed.zero.GatheredParameters`, the same collective on every rank),
ZeRO-3's forward and backward module hooks are taken off for the call (they would release the gathered
parameters after each submodule's forward and fetch them again), and put back after: registered anew by
DeepSpeed's own `_register_deepspeed_module`, which also invalidates the recorded fetch order, so the
next training forward records it again. Memory bound: each rank holds the full weights for the call.
The engine's hooks are shared by every thread: a trainer thread's forward of the same engine during a
call is not supported."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def zero_stage(engine: Any) -> int:
    stage_of = getattr(engine, "zero_optimization_stage", None)
    return stage_of() if callable(stage_of) else 0


@contextmanager
def gathered_zero3(engine: Any) -> Iterator[None]:
    """Inside: the engine's module with every parameter gathered and no ZeRO-3 hooks (a no-op below stage 3).
    Every rank must enter it together: it all-gathers once."""
    if zero_stage(engine) != 3:
        yield
        return
    import deepspeed

    offload = _parameter_offload(engine)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        _remove_hooks(offload)
        try:
            yield
        finally:
            # counting from the root's id, as the first registration did: every module keeps its ds_id
            offload._register_deepspeed_module(offload.module, count=[offload.module.ds_id])


def _parameter_offload(engine: Any) -> Any:
    """The object holding ZeRO-3's module hooks: the ZeRO-3 optimizer's `parameter_offload`, or, for an
    engine built without an optimizer, the engine's `DeepSpeedZeRoOffload` itself."""
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)
    if offload is None or not hasattr(offload, "forward_hooks"):
        raise ValueError(
            f"the ZeRO-3 engine's optimizer ({type(optimizer).__name__}) holds no parameter offload hooks to "
            "take off for generation: pass the DeepSpeedEngine that deepspeed.initialize returned"
        )
    return offload


def _remove_hooks(offload: Any) -> None:
    for parameter in offload.module.parameters():
        parameter.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
