"""Full weights for one rollout call on a DeepSpeed ZeRO-3 engine, with no collectives inside the call.

ZeRO-3's module hooks all-gather a submodule's partitioned parameters before its forward and release
them after, so ranks running different numbers of forwards (their own prompts, their own stopping)
fall out of step. As DeepSpeed's hybrid engine and TRL's `ds3_gather_for_generation` do, every
parameter is gathered once (`deepspeed.zero.GatheredParameters`, the same collective on every rank),
ZeRO-3's forward and backward module hooks are taken off for the call (they would release the gathered
parameters after each submodule's forward and fetch them again), and put back after: registered anew by
DeepSpeed's own `_register_deepspeed_module`, which also invalidates the recorded fetch order, so the
next training forward records it again. ZeRO-3's hook at the start of the root module's forward is taken
off for the call too (`start_of_forward_hook_off`; TRL's `remove_hooks` leaves it on): it resets the
parameter coordinator's step, and while the fetch order is not yet recorded that reset checks it against
every other rank with a broadcast, so a rank that runs fewer forwards than another (no prompts, one
refused, a shorter budget) would leave the other waiting there.
Memory bound: each rank holds the full weights for the call.
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
            with start_of_forward_hook_off(engine):
                yield
        finally:
            # counting from the root's id, as the first registration did: every module keeps its ds_id
            offload._register_deepspeed_module(offload.module, count=[offload.module.ds_id])


@contextmanager
def start_of_forward_hook_off(engine: Any) -> Iterator[None]:
    """Inside: no ZeRO-3 step reset at the start of each forward of the engine's module (a no-op below stage
    3, or before the engine has its ZeRO-3 hooks). The hook is put back where it was among the module's
    forward pre-hooks (a hook's key is its registration number, so sorting the keys restores the order)."""
    offload = _offload_or_none(engine) if zero_stage(engine) == 3 else None
    handle = getattr(offload, "fwd_pre_hook", None)
    if handle is None:
        yield
        return
    hooks = offload.module._forward_pre_hooks
    hook = hooks.pop(handle.id, None)
    try:
        yield
    finally:
        if hook is not None:
            hooks[handle.id] = hook
            for key in sorted(hooks):
                hooks.move_to_end(key)


def _offload_or_none(engine: Any) -> Any:
    """The object holding ZeRO-3's module hooks: the ZeRO-3 optimizer's `parameter_offload`, or, for an
    engine built without an optimizer, the engine's `DeepSpeedZeRoOffload` itself; None if neither."""
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)
    return offload if offload is not None and hasattr(offload, "forward_hooks") else None


def _parameter_offload(engine: Any) -> Any:
    offload = _offload_or_none(engine)
    if offload is None:
        optimizer = getattr(engine, "optimizer", None)
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
