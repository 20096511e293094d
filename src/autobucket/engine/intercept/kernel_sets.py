"""The scope under which a forward runs the engine's own batch-invariant kernels, for this thread only;
the model is not changed. Two kernel sets, chosen by the model's device: on a CPU, every linear on
prepacked weights (`packed_linear.py`) and every attention call on the C++ invariant kernel
(`invariant_attention.py`); on a CUDA device, the Triton set (`triton_set.py`)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import transformers

from autobucket.engine.intercept.attention import dispatches, kernel_attention
from autobucket.engine.kernels.invariant_attention import invariant_sdpa
from autobucket.engine.kernels.library import load_invariant_kernels
from autobucket.engine.kernels.onednn_probes import check_fp32_precision, onednn_available
from autobucket.engine.kernels.packed_linear import PackedLinears, packed_linears
from autobucket.engine.kernels.triton import available as triton_available


def check_invariant_model(model: torch.nn.Module) -> None:
    """What `Rollout(kernels="invariant")` and `autobucket.invariant` both check first: refuse models whose
    attention cannot be reached (eager attention) and fp32 set to compute in a lower precision, warn
    where this CPU has no oneDNN linear for the model's dtype, then build the kernel."""
    check_call_settings(model)
    dtype = next(model.parameters()).dtype
    if not onednn_available(dtype):
        warnings.warn(
            f"autobucket: kernels='invariant' has no oneDNN {dtype} linear on this CPU; the model's own "
            "linears run (not batch-invariant)",
            RuntimeWarning,
            stacklevel=4,
        )
    if runs_triton_set(next(model.parameters()).device):
        check_call_settings(model)
        return
    load_invariant_kernels()


def runs_triton_set(device: torch.device) -> bool:
    """Whether a forward on `device` runs the Triton set: CUDA devices, and CPU tensors under the tests'
    `forced_on_cpu` switch (never on where its module was not imported: CPU callers skip triton's import)."""
    if device.type == "cpu" and "autobucket.engine.intercept.triton_set" not in sys.modules:
        return False
    if not triton_available():
        return False
    from autobucket.engine.intercept.triton_set import runs_triton_set as chosen

    return chosen(device)


def check_call_settings(model: torch.nn.Module) -> None:
    """What a trainer may change after handing the model over, checked again at each call: the model's
    attention (`set_attn_implementation`: an eager model's attention would read cache columns the
    invariant kernels never fill) and oneDNN's fp32 precision (a trainer turning on bf16 math for its own
    steps would otherwise lower the rollout's, silently), and the model's dtype (`model.half()` between
    calls)."""
    check_kernel_attention(model)
    check_kernel_dtype(model)
    check_fp32_precision()  # bf16 linears run fp32 GEMMs too


KERNEL_DTYPES = (torch.float32, torch.bfloat16)


ROLLOUT_DEVICE_FIX = "use RolloutConfig(kernels='torch') there (the model's own forward)"


def check_kernel_device(device: torch.device, fix: str = ROLLOUT_DEVICE_FIX) -> None:
    """The kernels run on CPUs (the C++ set) and CUDA devices (the Triton set, where triton is installed).
    `Rollout` checks the device it reads off the model at construction and before each call's other work,
    and `autobucket.invariant` on entering its block (`fix` names what that caller should do instead)."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        if triton_available():
            return
        raise ValueError(
            f"kernels='invariant' runs CUDA models on Triton kernels, and triton is not installed: "
            f"pip install triton (torch's CUDA wheels bring it), or {fix}"
        )
    raise ValueError(
        f"kernels='invariant' runs on CPU and CUDA models, and this model is on {device}: {fix}, "
        "or move the model to the CPU"
    )


def check_kernel_dtype(model: torch.nn.Module) -> None:
    """The kernels compute in fp32 and bf16 (the attention and the fixed-order linears have no fp16 form)."""
    dtype = next(model.parameters()).dtype
    if dtype not in KERNEL_DTYPES:
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"kernels='invariant' computes in float32 or bfloat16, but {type(model).__name__} is {name}: load it "
            "in (or move it to) torch.bfloat16 or torch.float32, or use RolloutConfig(kernels='torch')"
        )


def check_kernel_attention(model: torch.nn.Module) -> None:
    """The invariant attention is reached where transformers calls 'sdpa'."""
    if not dispatches(model):
        implementation = getattr(model.config, "_attn_implementation", None)
        if implementation == "sdpa":  # configured for it, but its layers call torch's SDPA themselves
            raise ValueError(
                f"kernels='invariant' runs its own attention kernel where transformers calls 'sdpa', but "
                f"{type(model).__name__}'s attention layers call torch's SDPA themselves in transformers "
                f"{transformers.__version__}, out of its reach: use RolloutConfig(kernels='torch') (or a transformers "
                "release whose class calls attention through its attention interface; 5.x for Falcon, StableLM)"
            )
        # A class without SDPA attention in this transformers release (Gemma 2 and gpt-oss in 5.x: softcapping,
        # attention sinks) cannot be switched to it: only the default kernels run it.
        switch = (
            "load it with (or switch it back to) attn_implementation='sdpa', or use"
            if getattr(type(model), "_supports_sdpa", True)
            else "this transformers release has no SDPA attention for it, so use"
        )
        raise ValueError(
            f"kernels='invariant' runs its own attention kernel where transformers calls 'sdpa', but "
            f"{type(model).__name__} has attn_implementation={implementation!r}: {switch} RolloutConfig(kernels='torch')"
        )


@contextmanager
def invariant_kernels(packs: PackedLinears, recompute_safe: bool = False, conv1d: bool = False) -> Iterator[None]:
    """This thread's forwards in the block run the invariant linears (packed in `packs`) and attention;
    `recompute_safe` for models that recompute forwards in backward (gradient checkpointing); `conv1d`
    for models with transformers `Conv1D` layers (`functions.has_conv1d`)."""
    with packed_linears(packs, recompute_safe, conv1d), kernel_attention(invariant_sdpa):
        yield


@contextmanager
def kernel_set(
    model: torch.nn.Module, packs: PackedLinears | None, recompute_safe: bool = False, conv1d: bool = False
) -> Iterator[None]:
    """`invariant_kernels` on a CPU; the Triton set's scope on a CUDA device (`packs` unused there: its
    linear reads the weights in place)."""
    if runs_triton_set(next(model.parameters()).device):
        from autobucket.engine.intercept.triton_set import triton_kernels

        with triton_kernels(model, conv1d):
            yield
        return
    assert packs is not None, "the CPU kernel set runs on packed weights"
    with invariant_kernels(packs, recompute_safe, conv1d):
        yield
