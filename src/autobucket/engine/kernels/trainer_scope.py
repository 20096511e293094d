"""`autobucket.invariant(model)`: the trainer's own forward on the engine's batch-invariant kernels.

Inside the block, this thread's forwards of `model` run every linear on the same prepacked weights and
every attention call on the same kernel as `Rollout(kernels="invariant")`, so a teacher-forced forward
of left-padded prompts + right-padded completions gives each completion token bitwise the logits the
rollout sampled it from, whatever the batch, padding, route, packing, chunking, refill order or n.

Autograd stays intact: the forward values come from the invariant kernels, the backward from ordinary
ones (a linear's gradients are its GEMMs on the live weight; attention's are those of SDPA recomputed
on the saved query, key and value), so gradients equal the unscoped backward to floating-point
tolerance. Only forward values carry the guarantee. Packed copies follow the weights' versions, so an
optimizer step repacks at the next forward (its cost is `PackedLinears.pack_ms`). Nothing on the model
changes; other threads' forwards are untouched."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autobucket.checks import require_finite
from autobucket.engine.kernels.packed_linear import PackedLinears
from autobucket.engine.kernels.scope import check_invariant_model, check_kernel_device, kernel_set
from autobucket.engine.model_access.function_routes import has_conv1d
from autobucket.engine.model_access.hf_compat import unwrap_model
from autobucket.engine.model_access.weight_versions import merged_adapters

# What a trainer with a model off the CPU should do instead (check_kernel_device names it)
_DEVICE_FIX = "run its forward outside autobucket.invariant(...) there (the model's own kernels)"

_PACKS: weakref.WeakKeyDictionary[torch.nn.Module, PackedLinears] = weakref.WeakKeyDictionary()


def packs_for(model: torch.nn.Module) -> PackedLinears:
    """The one set of packed copies of `model`'s weights shared by every trainer scope on it (each
    `Rollout` keeps its own, which `Rollout.refresh_weights()` marks stale)."""
    packs = _PACKS.get(model)
    if packs is None:
        packs = _PACKS[model] = PackedLinears()
    return packs


@contextmanager
def invariant(model: Any, packed_weights_mb: float | None = None) -> Iterator[PackedLinears]:
    """Run this thread's forwards (and backwards) of `model` inside the block on the batch-invariant
    kernels of `RolloutConfig(kernels="invariant")`; yields the packed weights (their `packs_made` and
    `pack_ms` say what repacking after weight updates cost). `model` may be a PeftModel or a DDP / FSDP /
    DeepSpeed / compiled wrapper, as `Rollout` takes. `packed_weights_mb` bounds the packed copies as
    `RolloutConfig(packed_weights_mb=...)` does (None: every linear packed); the values do not depend on
    it (on a CUDA model the Triton set runs, with nothing packed). Raises ValueError for models the kernels
    cannot reach (eager attention, a device other than CPU and CUDA, CUDA without triton), for fp32
    set to compute in a lower precision, or for a negative budget."""
    if packed_weights_mb is not None:
        require_finite("packed_weights_mb", packed_weights_mb, "pass megabytes >= 0, or None for no limit", minimum=0.0)
    inner = unwrap_model(model)
    check_kernel_device(next(inner.parameters()).device, _DEVICE_FIX)
    check_invariant_model(inner)
    packs = packs_for(inner)
    packs.budget_bytes = None if packed_weights_mb is None else int(packed_weights_mb * 2**20)
    packs.follow_merges(merged_adapters(inner))
    checkpointing = any(getattr(module, "gradient_checkpointing", False) is True for module in inner.modules())
    with kernel_set(inner, packs, recompute_safe=checkpointing, conv1d=has_conv1d(inner)):
        yield packs
