"""Linear layers on prepacked weights that follow the live weights.

`F.linear` on an unpacked weight lets MKL reorder the weight on every call and pick its blocking by the
batch size, so a row's output can depend on how many other rows ride along (measured: 4.8e-7 between
M = 1 and M = 2 on a 256 -> 1,024 linear, AMD EPYC). oneDNN on a weight reordered once
(`mkldnn._reorder_linear_weight`) is faster on the decode shapes that dominate (the 8 x 256 x 32,000 head:
1.44 vs 3.3 ms, Intel Xeon) and gave a row bitwise the same output for M = 2 ... 4,096 on every shape
probed; M = 1 took another path on one shape (1,536 -> 576), so a single row runs as a batch of two.

Every linear the engine's forwards run is routed here by `packed_linears` — a `TorchFunctionMode`, so
only this thread's forwards inside the block see it and the model's modules are never touched (LoRA
layers' base and low-rank linears are ordinary `F.linear` calls and are packed alike; GPT-2's `Conv1D`
is an `addmm` on a transposed parameter and is packed transposed). A packed copy is
keyed on the weight's identity, `data_ptr()`, `_version` and the process's optimizer steps
(`model_access/weight_versions.py`: fused optimizers do not bump `_version`): an `optimizer.step()`, a
`copy_` under `no_grad` or `load_state_dict` between calls and the next forward repacks; a write
through `.data` (`param.data.copy_(...)`) bypasses the version counter and needs `refresh()`
(`Rollout.refresh_weights()`)."""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autobucket.engine.model_access.weight_versions import tensor_version


@functools.cache  # read on every linear call of a forward: the answer is fixed for the process
def onednn_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN packed linears run for `dtype` on this CPU: fp32, and bf16 (computed in fp32)."""
    return torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16)


@dataclass
class _Pack:
    owner: weakref.ref  # the weight this copy was made from
    version: tuple[int, int | None, int]  # (data_ptr, _version, optimizer steps) when packed
    packed: torch.Tensor  # oneDNN-blocked copy of the weight

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class PackedLinears:
    """The packed copies of one model's weights (kept across calls) and what packing cost."""

    def __init__(self) -> None:
        self._packs: dict[int, _Pack] = {}
        self.packs_made = 0  # packs made, first ones and repacks after weight updates
        self.pack_ms = 0.0

    @property
    def nbytes(self) -> int:
        return sum(pack.nbytes for pack in self._packs.values())

    def refresh(self) -> None:
        """Drop every packed copy: the next forward repacks (after writes that bypass version counters)."""
        self._packs.clear()

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recompute_safe: bool = False
    ) -> torch.Tensor:
        """x [..., K], weight [N, K], bias [N] | None -> [..., N], like `F.linear`. Under autograd the
        gradients are ordinary GEMMs'; `recompute_safe` (gradient checkpointing on): see `_with_values`."""
        pack = self._pack_for(weight, x, transposed=False)
        if pack is None:
            return F.linear(x, weight, bias)
        if _needs_grad(x, weight, bias):
            if recompute_safe:
                return _with_values(F.linear(x, weight, bias), _packed_matmul(x.detach(), pack, _detached(bias)))
            return _PackedLinearFunction.apply(x, weight, bias, pack, False)
        return _packed_matmul(x, pack, bias)

    def addmm(
        self, bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recompute_safe: bool = False
    ) -> torch.Tensor:
        """bias [N] + x [M, K] @ weight [K, N]: GPT-2's `Conv1D` layers (weights stored transposed)."""
        pack = self._pack_for(weight, x, transposed=True)
        if pack is None:
            return torch.addmm(bias, x, weight)
        if _needs_grad(x, weight, bias):
            if recompute_safe:
                return _with_values(torch.addmm(bias, x, weight), _packed_matmul(x.detach(), pack, bias.detach()))
            return _PackedLinearFunction.apply(x, weight, bias, pack, True)
        return _packed_matmul(x, pack, bias)

    def _pack_for(self, weight: torch.Tensor, x: torch.Tensor, transposed: bool) -> _Pack | None:
        if not _eligible(weight, x):
            return None
        pack, version = self._packs.get(id(weight)), tensor_version(weight)
        if pack is not None and pack.owner() is weight and pack.version == version:
            return pack
        started = time.perf_counter()
        dense = weight.detach().t().contiguous() if transposed else weight.detach()  # [N, K]
        # bf16 weights are packed as fp32 (exact) and run fp32 GEMMs: oneDNN's bf16 GEMM is not batch-
        # invariant on every shape (measured: [M, 1024] x [1024, 256], a row's output depends on M),
        # its fp32 GEMM was on every shape probed; the output is rounded to bf16 as a bf16 GEMM's is.
        packed = torch.ops.mkldnn._reorder_linear_weight(dense.float(), 64)  # batch hint: a decode batch
        pack = _Pack(weakref.ref(weight), version, packed)
        self._packs[id(weight)] = pack
        self.packs_made += 1
        self.pack_ms += (time.perf_counter() - started) * 1e3
        return pack


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


class _WithValues(torch.autograd.Function):
    """`native`'s autograd graph carrying `values` (same shape) as its forward result."""

    @staticmethod
    def forward(ctx, native, values):  # type: ignore[override]
        return values

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        return grad_output, None


def _with_values(native: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The packed kernel's values on the ordinary linear's graph. Gradient checkpointing recomputes a
    layer's forward during backward, where no `TorchFunctionMode` is active, and requires the same saved
    tensors as the first forward: so the first forward saves what the ordinary linear saves (it runs,
    once more than otherwise) and only the values it passes on are the invariant ones."""
    return _WithValues.apply(native, values)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _PackedLinearFunction(torch.autograd.Function):
    """A trainer's forward under `autobucket.invariant`: values from the packed kernel, gradients from
    ordinary GEMMs on the live weight (`weight` [N, K], or [K, N] for `Conv1D` when `transposed`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, pack, transposed):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.transposed, ctx.has_bias = transposed, bias is not None
        return _packed_matmul(x, pack, bias)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        dense = weight.t() if ctx.transposed else weight  # [N, K]
        grad_rows = grad_output.reshape(-1, grad_output.shape[-1])  # [M, N]
        grad_x = (grad_rows @ dense).reshape(x.shape) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_rows.t() @ x.reshape(-1, x.shape[-1])  # [N, K]
            grad_weight = grad_weight.t() if ctx.transposed else grad_weight
        grad_bias = grad_rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None


def _packed_matmul(x: torch.Tensor, pack: _Pack, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).float()  # [M, K] fp32 (see _pack_for); 2-D was 10-15% faster than 3-D
    bias = None if bias is None else bias.float()
    if rows.shape[0] == 1:  # one row: oneDNN's M = 1 path can differ, run it as two
        out = torch.ops.mkldnn._linear_pointwise(rows.expand(2, -1), pack.packed, bias, "none", [], "")[:1]
    else:
        out = torch.ops.mkldnn._linear_pointwise(rows, pack.packed, bias, "none", [], "")
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def _eligible(weight: torch.Tensor, x: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu" and weight.dim() == 2 and x.dtype == weight.dtype and x.shape[-1] > 0
        and x.numel() > 0 and onednn_available(weight.dtype)
    )  # fmt: skip


class _PackedLinearMode(TorchFunctionMode):
    def __init__(self, packs: PackedLinears, recompute_safe: bool) -> None:
        super().__init__()
        self.packs, self.recompute_safe = packs, recompute_safe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            kwargs = kwargs or {}
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return self.packs.linear(x, weight, bias, self.recompute_safe)
        if func is torch.addmm and _is_conv1d_call(args, kwargs):
            return self.packs.addmm(*args, recompute_safe=self.recompute_safe)
        return func(*args, **(kwargs or {}))


def _is_conv1d_call(args: tuple, kwargs: dict | None) -> bool:
    """`torch.addmm(bias, x, weight)` as transformers' `Conv1D` calls it: a parameter as the weight,
    beta = alpha = 1 (other addmm calls are left alone)."""
    return (
        not kwargs and len(args) == 3 and isinstance(args[2], torch.nn.Parameter) and args[1].dim() == 2
        and args[0].dim() == 1
    )  # fmt: skip


@contextmanager
def packed_linears(packs: PackedLinears, recompute_safe: bool = False) -> Iterator[None]:
    """This thread's `F.linear` calls inside the block run on `packs` (mode stacks are thread-local);
    `recompute_safe`: the model recomputes forwards in backward (gradient checkpointing), see `_with_values`."""
    with _PackedLinearMode(packs, recompute_safe):
        yield


def check_fp32_precision() -> None:
    """Refuse to run fp32 models where oneDNN was told to compute fp32 matmuls in a lower precision."""
    setting = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", "none")
    fpmath = os.environ.get("ONEDNN_DEFAULT_FPMATH_MODE", "").strip().upper()
    if setting not in ("none", "ieee") or fpmath not in ("", "STRICT"):
        raise ValueError(
            f"kernels='invariant' computes fp32 models in strict fp32, but torch.backends.mkldnn.matmul."
            f"fp32_precision={setting!r} and ONEDNN_DEFAULT_FPMATH_MODE={fpmath!r} ask oneDNN for a lower "
            "precision: reset them (fp32_precision='ieee', unset the variable) or use kernels='hf'"
        )
