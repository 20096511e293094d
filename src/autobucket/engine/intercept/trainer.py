"""`autobucket.invariant(model)`: the trainer's own forward on the engine's batch-invariant kernels.

Inside the block, this thread's forwards of `model` run every linear on the same GEMM kernel and every
attention call on the same kernel as `Rollout(kernels="invariant")`, so a teacher-forced forward
of left-padded prompts + right-padded completions gives each completion token bitwise the logits the
rollout sampled it from, whatever the batch, padding, route, packing, chunking, refill order or n.
A forward given no position ids and a mask with padding before real tokens gets them counted over the
real tokens, as generation counts them (`trainer_positions.py`), so the forward trainers write (input
ids and attention mask only) keeps the guarantee.

Autograd stays intact: the forward values come from the invariant kernels, the backward from ordinary
ones (a linear's gradients are its GEMMs on the live weight; attention's are those of SDPA recomputed
on the saved query, key and value), so gradients equal the unscoped backward to floating-point
tolerance. Only forward values carry the guarantee. Nothing on the model changes but the position
hook, held while a scope on it is open in any thread and removed with the last; other threads' forwards
are untouched (the hook acts only in the scope's context).

Weights: the scope keeps no packed copies. Each GEMM reads the weight as it is at that call (oneDNN
reorders it per call, the fixed-order kernel reads it in place), bitwise the values a packed copy of
the same weight gives (`PackedLinears`' budget path), so no write can leave the scope computing with
old weights, whatever its path: an optimizer step, `copy_` under `no_grad`, `load_state_dict`, and
writes no version counter sees (`p.data.copy_(...)`, `p.data = t`, peft's merge). A kept copy could
only be checked against the live weight by reading all of it, which costs what reading it for the GEMM
costs; a trainer's forward has many rows per weight, so the per-call reorder is a small part of it.
`Rollout`s keep their packs (`Rollout.refresh_weights()` after `.data` writes)."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._dynamo.eval_frame import OptimizedModule

from autobucket.checks import require_finite
from autobucket.engine.intercept.active import forward_with
from autobucket.engine.intercept.functions import has_conv1d
from autobucket.engine.intercept.kernel_sets import check_invariant_model, check_kernel_device, kernel_set
from autobucket.engine.intercept.trainer_positions import positions_over_real_tokens
from autobucket.engine.kernels.packed_linear import PackedLinears
from autobucket.engine.model_access.hf_compat import unwrap_model
from autobucket.engine.plan.forward_plan import trainer_plan

# What a trainer with a model off the CPU should do instead (check_kernel_device names it)
_DEVICE_FIX = "run its forward outside autobucket.invariant(...) there (the model's own kernels)"

# The scope's packed-copy budget: none kept, every GEMM on the live weight (see the module docstring)
LIVE_WEIGHTS_BYTES = 0

_PACKS: weakref.WeakKeyDictionary[torch.nn.Module, PackedLinears] = weakref.WeakKeyDictionary()


def packs_for(model: torch.nn.Module) -> PackedLinears:
    """The `PackedLinears` every trainer scope on `model` runs its linears through: it keeps no copies
    (`nbytes` stays 0, `unpacked_calls` counts the GEMMs on live weights), so there is nothing to refresh."""
    packs = _PACKS.get(model)
    if packs is None:
        packs = _PACKS[model] = PackedLinears(budget_bytes=LIVE_WEIGHTS_BYTES)
    return packs


@contextmanager
def invariant(model: Any, packed_weights_mb: float | None = None) -> Iterator[PackedLinears]:
    """Run this thread's forwards (and backwards) of `model` inside the block on the batch-invariant
    kernels of `RolloutConfig(kernels="invariant")`, on the weights as they are at each call; yields the
    scope's `PackedLinears` (no copies kept: `unpacked_calls` counts the GEMMs). `model` may be a
    PeftModel or a DDP / FSDP / DeepSpeed wrapper, as `Rollout` takes, but not compiled
    (`check_not_compiled`: pass the module a `torch.compile` wrapper holds, `._orig_mod`).
    `packed_weights_mb` is accepted for older callers and bounds nothing (a DeprecationWarning says so).
    On a CUDA model the Triton set runs (`triton_set.py`). Raises ValueError for models the kernels
    cannot reach (eager attention, a device other than CPU and CUDA, CUDA without triton, compiled), for
    fp32 set to compute in a lower precision, or for a negative `packed_weights_mb`."""
    if packed_weights_mb is not None:
        require_finite("packed_weights_mb", packed_weights_mb, "pass megabytes >= 0, or None for no limit", minimum=0.0)
        warnings.warn(
            f"autobucket.invariant(packed_weights_mb={packed_weights_mb}) bounds nothing: the scope keeps no "
            "packed copies (every GEMM reads the live weight); drop the argument",
            DeprecationWarning,
            stacklevel=3,
        )
    check_not_compiled(model)
    inner = unwrap_model(model)
    check_kernel_device(next(inner.parameters()).device, _DEVICE_FIX)
    check_invariant_model(inner)
    packs = packs_for(inner)
    packs.budget_bytes = LIVE_WEIGHTS_BYTES
    checkpointing = any(getattr(module, "gradient_checkpointing", False) is True for module in inner.modules())
    with (
        forward_with(plan=trainer_plan(inner)),
        kernel_set(inner, packs, recompute_safe=checkpointing, conv1d=has_conv1d(inner)),
        positions_over_real_tokens(inner),
    ):
        yield packs


def check_not_compiled(model: Any) -> None:
    """A ValueError naming the first compiled module in `model` (a `torch.compile` wrapper, or a module
    compiled in place by `.compile()`) and what to pass instead. A compiled forward runs the graph dynamo
    traced, and under tracing the scope's interceptors call the builtin linears (dynamo reads no context
    variable), so its values are not the rollout's: the scope would silently not hold."""
    if not isinstance(model, torch.nn.Module):
        return
    for name, module in model.named_modules():
        where = f"the model's submodule {name!r}" if name else f"the model passed ({type(model).__name__})"
        if isinstance(module, OptimizedModule):
            instead = f"model.get_submodule({name!r})._orig_mod in its place" if name else "model._orig_mod"
            raise ValueError(
                f"autobucket.invariant cannot run a torch.compile'd module on its batch-invariant kernels, and "
                f"{where} is one (its graph runs inductor's kernels, so its logprobs would differ from the "
                f"rollout's): pass the module it wraps ({instead}) and call that inside the block"
            )
        if getattr(module, "_compiled_call_impl", None) is not None:
            raise ValueError(
                f"autobucket.invariant cannot run a torch.compile'd module on its batch-invariant kernels, and "
                f"{where} was compiled in place with .compile() (its graph runs inductor's kernels, so its "
                "logprobs would differ from the rollout's): pass a model that was not compiled (compile a "
                "wrapper for the trainer's other forwards, torch.compile(model), and pass model to the scope)"
            )
