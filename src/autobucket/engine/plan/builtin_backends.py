"""The three built-in backends: the model's own torch code, the engine's C++ kernels, its Triton kernels.

- "torch": every op is the model's own code (nothing intercepted). Shared-prefix decode attention is the
  engine's split softmax over torch's SDPA (`kernels/cascade_attention.py`), equal to attention over the
  concatenated keys up to rounding; selection and log-probabilities are torch ops.
- "cpu": linears on prepacked, batch-invariant weights and every attention call on the invariant kernel
  (as one kernel set, `intercept/kernel_sets.py`), the decode-only attention kernel, and the fused
  rotary / SiLU-and-multiply / RMSNorm, each bitwise the modeling code's values; CPU tensors only.
- "triton": the Triton set's invariant linear, attention and RMSNorm (CUDA, or CPU tensors under the
  tests' interpreter switch); no shared-prefix kernel yet."""

from __future__ import annotations

import torch

from autobucket.engine.intercept.attention import dispatches
from autobucket.engine.intercept.elementwise import cpu_elementwise
from autobucket.engine.intercept.kernel_sets import KERNEL_DTYPES, runs_triton_set
from autobucket.engine.intercept.modeling import llama_modeling_module
from autobucket.engine.kernels.invariant_attention import decode_kernel_builds, decode_sdpa, invariant_sdpa
from autobucket.engine.kernels.library import kernel_library_builds
from autobucket.engine.kernels.packed_linear import packed_linears
from autobucket.engine.kernels.trainer_reductions import log_softmax_at_widened
from autobucket.engine.kernels.triton import available as triton_available
from autobucket.engine.plan import ops
from autobucket.engine.plan.backends import Backend, Supplied


def _parameter(model: torch.nn.Module) -> torch.Tensor:
    return next(model.parameters())


class TorchBackend(Backend):
    """The model's own code for every op."""

    name = "torch"

    def supply(self, op: str, model: torch.nn.Module) -> Supplied:
        return None


def _kernel_set_refusal(model: torch.nn.Module, device_ok: bool, where: str) -> str | None:
    """Why a kernel set cannot run `model`'s linears and attention (None: it can)."""
    parameter = _parameter(model)
    if not device_ok:
        return f"the {where} kernels do not run on {parameter.device.type} tensors"
    if parameter.dtype not in KERNEL_DTYPES:
        return f"the kernels compute in float32 or bfloat16, and the model is {str(parameter.dtype).removeprefix('torch.')}"
    if not dispatches(model):
        return "the model's attention does not go through transformers' 'sdpa' interface"
    return None


class CpuBackend(Backend):
    """The engine's C++ kernels."""

    name = "cpu"

    def supply(self, op: str, model: torch.nn.Module) -> Supplied:
        on_cpu = _parameter(model).device.type == "cpu" and not runs_triton_set(_parameter(model).device)
        if op in ops.ELEMENTWISE_OPS:
            return self._elementwise(op, model, on_cpu)
        if op == ops.LOGPROBS:
            if not (on_cpu and _parameter(model).dtype == torch.bfloat16 and kernel_library_builds()):
                return "its log-softmax kernel serves bf16 CPU models (torch's is exact in fp32)"
            return log_softmax_at_widened
        if op == ops.SELECTION:
            return "the engine's sampler runs torch ops"
        refusal = _kernel_set_refusal(model, on_cpu, "C++")
        if refusal is not None:
            return refusal
        if op == ops.LINEAR:
            return packed_linears
        if op == ops.DECODE_ATTENTION and not decode_kernel_builds():
            return "its decode attention kernel does not build here"
        return decode_sdpa if op == ops.DECODE_ATTENTION else invariant_sdpa

    @staticmethod
    def _elementwise(op: str, model: torch.nn.Module, on_cpu: bool) -> Supplied:
        if not on_cpu:
            return "the fused elementwise kernels run on CPU tensors"
        if llama_modeling_module(model) is None:
            return f"{type(model).__name__} is not a transformers Llama-family model"
        function = cpu_elementwise(model).get(op)
        if function is None:
            return "the kernel library does not build here, or the modeling code is not the form the kernel reproduces bitwise"
        return function


class TritonBackend(Backend):
    """The Triton set: CUDA tensors (or CPU tensors under the interpreter switch)."""

    name = "triton"

    def supply(self, op: str, model: torch.nn.Module) -> Supplied:
        device = _parameter(model).device
        if not triton_available():
            return "triton is not installed"
        if op in (ops.ROTARY, ops.GATED_MLP, ops.SELECTION, ops.LOGPROBS):
            return f"the Triton set has no {op} kernel"
        if op == ops.SHARED_PREFIX_ATTENTION:
            return "the Triton set has no shared-prefix kernel: each row reads its own copy"
        refusal = _kernel_set_refusal(model, runs_triton_set(device), "Triton")
        if refusal is not None:
            return refusal
        # imported here: these modules import triton, which CPU callers never need
        from autobucket.engine.intercept.triton_norms import triton_rms_norm
        from autobucket.engine.intercept.triton_set import TritonLinears, triton_sdpa

        return {ops.LINEAR: TritonLinears, ops.RMS_NORM: triton_rms_norm}.get(op, triton_sdpa)
