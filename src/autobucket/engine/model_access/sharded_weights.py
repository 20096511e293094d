"""Full weights for one call on a model sharded over ranks by FSDP2 (`fully_shard`) (`gathered_weights`),
or the shards kept and FSDP's state put back after a lockstep call's sharded forwards (`sharded_forwards`,
paired across ranks by `lockstep.py`).

Why gather once: a sharded model all-gathers each layer's shards inside every forward, a collective
every rank must join. The engine runs a data-dependent number of forwards per rank (its own prompts,
its own stopping), so ranks fall out of step: the rank with more work waits on a collective nobody
joins (or, with same-shaped layers, pairs with the wrong one). Here every FSDP group is all-gathered
once at the start of the call (the same collectives in the same module order on every rank), kept
unsharded through the call's forwards (no reshard after forward, so FSDP's hooks find the weights
present and communicate nothing), and resharded after. The values are FSDP's own all-gather of the
shards: bitwise the weights the trainer's sharded forward computes with.

Memory bound: each rank holds the full (unsharded) weights of every group for the whole call, on top
of its shards: parameter bytes x (1 + 1/world size), as an FSDP root with `reshard_after_forward=False`.

The model is left as found: the groups that were sharded are sharded again (the same parameter objects
registered), each group's reshard-after-forward setting and the root's automatic choice restored, and
FSDP's record of the forward order (kept for backward prefetching) trimmed to what it held before.
FSDP2 has no public way to keep groups unsharded through forwards and put the root's automatic
setting back (`set_reshard_after_forward` overwrites it), so the group attributes it keeps that setting
in are read and restored here. FSDP's state is per model, not per thread: a trainer thread's forward of the same FSDP model during
a call would find it unsharded (the same values), and is not supported."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from autobucket.engine.model_access.hf_compat import class_names


def fsdp2_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules `fully_shard` was applied to, outermost first (found by class name: no import of
    torch.distributed for a model that is not sharded)."""
    return [module for module in model.modules() if "FSDPModule" in class_names(module)]


def is_sharded(model: Any) -> bool:
    return isinstance(model, torch.nn.Module) and bool(fsdp2_modules(model))


def zero3_partitioned(model: Any) -> bool:
    """Whether DeepSpeed ZeRO-3 partitioned `model`'s parameters (its hooks all-gather each submodule's
    inside the forward): the attribute ZeRO-3 gives every parameter, read without importing deepspeed."""
    return isinstance(model, torch.nn.Module) and any(hasattr(p, "ds_status") for p in model.parameters())


def gathering_communicates(model: torch.nn.Module) -> bool:
    """Whether `gathered_weights(model)` would all-gather: some group is sharded now. Inside an enclosing
    `gathered_weights` (a caller generating several times on one gather) every group is unsharded, and
    a nested gathering communicates nothing, so ranks may make different numbers of calls there."""
    if not isinstance(model, torch.nn.Module):
        return False
    groups = (g for module in fsdp2_modules(model) for g in module._get_fsdp_state()._fsdp_param_groups)
    return any(not group.is_unsharded for group in groups)


@dataclass
class _GroupState:
    """What the call changes on one FSDP parameter group, to put back after it."""

    group: Any  # FSDPParamGroup
    was_sharded: bool
    post_forward_mesh_info: Any  # None: no reshard after forward (FSDP's own encoding of the flag)
    forward_indices: int  # len(group._post_forward_indices)


@contextmanager
def gathered_weights(model: torch.nn.Module) -> Iterator[None]:
    """Inside: `model`'s FSDP2 groups unsharded, its forwards free of collectives (a no-op for a model
    that is not sharded). Every rank must enter it, in the same order relative to its other
    collectives: it all-gathers once per group that is sharded (none when nested in another)."""
    modules = fsdp2_modules(model)
    if not modules:
        yield
        return
    with _state_restored(modules) as groups:
        _unsharded_through_forwards(modules, groups)
        yield


@contextmanager
def sharded_forwards(model: torch.nn.Module, called: torch.nn.Module) -> Iterator[None]:
    """Inside: forwards of `called` (the module the engine calls, inside `model`) run FSDP's own
    per-group all-gathers, each rank keeping only its shards between them (`sharded_weights="lockstep"`).
    FSDP modules above `called` (a PeftModel root holding the embeddings' shards) are never entered by
    those forwards, so their groups are all-gathered once here (the same collectives on every rank) and
    kept for the call. After: the model as found (`gathered_weights`' restore), the records of FSDP's
    forward order included, however many forwards ran."""
    modules = fsdp2_modules(model)
    if not modules:
        yield
        return
    inside = {id(module) for module in called.modules()}
    with _state_restored(modules) as groups:
        _unsharded_through_forwards([module for module in modules if id(module) not in inside], groups)
        yield


@contextmanager
def _state_restored(modules: list[torch.nn.Module]) -> Iterator[list[_GroupState]]:
    """What a call changes on the FSDP states of `modules` (outermost first), put back after it."""
    _initialise_roots(modules)
    states = _unique([module._get_fsdp_state() for module in modules])
    groups = [
        _GroupState(g, g.is_sharded, g.post_forward_mesh_info, len(g._post_forward_indices))
        for state in states
        for g in state._fsdp_param_groups
    ]
    automatic = [(state, state._auto_reshard_after_forward) for state in states]
    orders = _unique([g.group.comm_ctx.post_forward_order for g in groups])
    order_lengths = [(order, len(order)) for order in orders]
    try:  # an unshard that fails part way (out of memory) still leaves the model as found
        yield groups
    finally:
        _restore(groups, automatic, order_lengths)


def _unsharded_through_forwards(modules: list[torch.nn.Module], groups: list[_GroupState]) -> None:
    """All-gather the groups of `modules` (in their order) and keep them so through every forward."""
    with torch.no_grad():  # FSDP2's unshard keeps version counters, which inference mode lacks
        for module in modules:
            module.unshard()
    mine = {id(g) for module in modules for g in module._get_fsdp_state()._fsdp_param_groups}
    for saved in groups:
        if id(saved.group) in mine:
            saved.group.post_forward_mesh_info = None  # FSDP's encoding of "no reshard after forward"


def _restore(groups: list[_GroupState], automatic: list, order_lengths: list) -> None:
    for saved in groups:
        saved.group.post_forward_mesh_info = saved.post_forward_mesh_info
        del saved.group._post_forward_indices[saved.forward_indices :]
        if saved.was_sharded:
            saved.group.reshard()  # frees the full weights, registers the shards again
    for state, value in automatic:
        state._auto_reshard_after_forward = value
    for order, length in order_lengths:
        del order[length:]


def _initialise_roots(modules: list[torch.nn.Module]) -> None:
    """FSDP decides which state is the root (whose default is not to reshard after forward) at the first
    forward; deciding it here, as that forward would, keeps the restored settings the trainer's."""
    for module in modules:  # outermost first: a root marks the states inside it as not roots
        state = module._get_fsdp_state()
        if state._is_root is None:
            state._lazy_init()


def _unique(items: list) -> list:
    seen: dict[int, Any] = {}
    for item in items:
        seen.setdefault(id(item), item)
    return list(seen.values())
