"""Which kernel set a `Rollout`'s forwards run (`RolloutConfig.kernels`), decided from the model as it is.

"auto" (the default) takes the engine's batch-invariant kernel set wherever every check `kernels="invariant"`
refuses on passes; elsewhere it stays "auto": the model's own linears and attention, with the engine's
elementwise and decode kernels where they run (the forward plan picks those per op). "invariant" requires
the engine's kernels (its checks raise instead); "torch" asks for the model's own ops. The answer names the set and why, so a fallback is never
silent (`Profile.kernels`, `Profile.kernels_reason`). It is read again at every call: a trainer may change
the model's dtype, device or attention between calls."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from autobucket.engine.intercept.attention import dispatches
from autobucket.engine.intercept.kernel_sets import KERNEL_DTYPES, runs_triton_set
from autobucket.engine.kernels.library import kernel_library_builds
from autobucket.engine.kernels.onednn_probes import check_fp32_precision, onednn_available
from autobucket.engine.model_access.hf_compat import attention_backend

if TYPE_CHECKING:
    from autobucket.config import RolloutConfig

ENGINE_KERNELS = "invariant"  # the engine's own kernels (`engine/kernels/`)
MODEL_OPS = "auto"  # resolved "auto": the model's own linears and attention, the engine's other kernels per op


class KernelChoice(NamedTuple):
    kernels: str  # the set the call's forwards run: ENGINE_KERNELS, MODEL_OPS or "torch"
    reason: str  # one line: why this set


def resolve_kernels(model: torch.nn.Module, config: RolloutConfig) -> KernelChoice:
    """The kernel set a call on `model` runs under `config`: "auto" resolved, any other value as given
    ("invariant" is refused by its own checks where it cannot hold, never replaced)."""
    if config.kernels != "auto":
        return KernelChoice(config.kernels, f"kernels={config.kernels!r} as configured")
    obstacle = engine_kernels_obstacle(model, config)
    if obstacle is None:
        return KernelChoice(ENGINE_KERNELS, "auto: the engine's kernels run this model on this CPU")
    return KernelChoice(MODEL_OPS, f"auto: the model's own linears and attention, since {obstacle}")


def engine_kernels_obstacle(model: torch.nn.Module, config: RolloutConfig) -> str | None:
    """Why "auto" does not take the engine's kernels for `model`, or None where it does: the conditions
    `kernels="invariant"` refuses on (device, dtype, attention, oneDNN, fp32 precision, the kernel build),
    checked without raising, plus the two where the engine's kernels exist but are not the faster choice
    (a CUDA device, a decode step `compile=True` asks for)."""
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    if device.type != "cpu" or runs_triton_set(device):
        # The speed case is made on CPUs; on CUDA the Triton set trades speed for invariance.
        return f"the model is on {device}: the default takes the engine's kernels on a CPU only"
    if dtype not in KERNEL_DTYPES:
        name = str(dtype).removeprefix("torch.")
        return f"the model is {name} and the engine's kernels compute in float32 or bfloat16"
    if not dispatches(model):
        return (
            f"{type(model).__name__}'s attention (attn_implementation={attention_backend(model)!r}) does not "
            "go through transformers' 'sdpa' interface, where the engine's attention kernel runs"
        )
    if not onednn_available(dtype):
        return "this torch build has no oneDNN linear for the engine's packed weights"
    try:
        check_fp32_precision()
    except ValueError:
        return "oneDNN is set to compute fp32 matmuls in a lower precision"
    if getattr(config, "compile", False) is True:
        # The compiled step runs the model's own ops; the engine's kernels decode eagerly.
        return "compile=True asks for the compiled decode step, which runs the model's own ops"
    if not kernel_library_builds():
        return "the engine's C++ kernel library does not build here (install g++ and ninja)"
    return None
