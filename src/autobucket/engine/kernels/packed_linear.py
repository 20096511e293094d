"""Linear layers on prepacked weights that follow the live weights.

`F.linear` on an unpacked weight lets MKL reorder the weight on every call and pick its blocking by the
batch size, so a row's output can depend on how many other rows ride along (M = 1 and M = 2 differ
in the last bits on some shapes). oneDNN on a weight reordered once (`mkldnn._reorder_linear_weight`)
is faster on the decode shapes that dominate (no reorder per call) and gave a row bitwise the same output for M = 2 ... 4,096 on every shape
probed; M = 1 took another path on one shape (1,536 -> 576), so a single row runs as a batch of two.

Every linear the engine's forwards run is routed here by `packed_linears` (`intercept/functions.py`: the
`F.linear` and `Conv1D` addmm calls of this thread's forwards inside the block, the model's modules never
touched; LoRA layers' base and low-rank linears are ordinary `F.linear` calls and are packed alike;
GPT-2's `Conv1D` is an `addmm` on a transposed parameter and is packed transposed). A packed copy is
keyed on the weight's identity, `data_ptr()`, `_version` and the process's optimizer steps
(`model_access/weight_versions.py`: fused optimizers do not bump `_version`): an `optimizer.step()`, a
`copy_` under `no_grad` or `load_state_dict` between calls and the next forward repacks; a write
through `.data` (`param.data.copy_(...)`) bypasses the version counter and needs `refresh()`
(`Rollout.refresh_weights()`).

The GEMMs themselves: `packed_matmul.py` (fp32: the fixed-order kernel, or oneDNN; bf16: oneDNN in the row
blocks `onednn_probes.py` found invariant for the shape)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from autobucket.engine.intercept.functions import (
    active_linears,
    linears_on,
    original_addmm,
    original_linear,
)
from autobucket.engine.kernels.fused_linear import FusedGroup, LinearFusion
from autobucket.engine.kernels.onednn_probes import (
    ROW_BLOCK,
    bf16_blocks_invariant,
    bf16_small_blocks_agree,
    fused_columns_agree,
    onednn_available,
)
from autobucket.engine.kernels.packed_matmul import (
    Pack,
    fixed_order_op,
    fixed_order_panels,
    packed_matmul,
    panel_bytes,
    panels_dtype,
    panels_shape,
)
from autobucket.engine.model_access.weight_versions import tensor_version


class PackedLinears:
    """The packed copies of one model's weights (kept across calls) and what packing cost.

    `budget_bytes` bounds the copies (None: every linear packed). Past it, a weight is not kept: its
    GEMM reads the live weight in oneDNN's plain layout, which oneDNN reorders per call into the same
    blocked layout and runs on the same kernel, so the values are bitwise the packed ones (probed on
    every shape of `tests/engine/kernels/test_packed_linear.py`, fp32 and bf16) at the cost of that reorder; a
    fixed-order weight gets its panels made for the call (the same values by construction). Weights
    are packed in the order the forward first meets them (the layers, then the output head)."""

    def __init__(self, budget_bytes: int | None = None, fuse: bool = False, fixed_order: bool | None = None) -> None:
        self._packs: dict[int, Pack] = {}
        self._fused: dict[int, _FusedPack] = {}  # id(group) -> its concatenated weight's pack
        self._held_bytes = 0
        self._merged_adapters: tuple | None = None  # the model's merged adapters when last followed
        self.budget_bytes = budget_bytes
        self.packs_made = 0  # packs made, first ones and repacks after weight updates
        self.pack_ms = 0.0
        self.unpacked_calls = 0  # GEMMs run on a live weight because the budget was full
        # `fuse`: bf16 linears that read one input run as one GEMM where the values stay bitwise the same
        # (`fused_linear.py`); the rollout's forwards fuse, the trainer's scope does not (its forwards
        # need gradients, and alternating both would repack)
        self.fusion = LinearFusion() if fuse else None
        # fp32 GEMMs on `fixed_order_linear` (None: wherever it is vectorized) or on oneDNN (False: the
        # benchmarks' comparison)
        self.fixed_order = fixed_order_op() is not None if fixed_order is None else fixed_order

    @property
    def nbytes(self) -> int:
        return self._held_bytes

    def follow_merges(self, merged: tuple) -> None:
        """`merged`: `weight_versions.merged_adapters` of the model about to run. peft merges an adapter
        into its base weight through `.data` (no version change), so a change of it marks every copy stale."""
        if merged != self._merged_adapters:
            self.refresh()
            self._merged_adapters = merged

    def refresh(self) -> None:
        """Mark every packed copy stale: the next forward repacks (after writes that bypass version
        counters), fixed-order panels in place where the weight's shape is unchanged."""
        for pack in self._packs.values():
            pack.version = None
        self._held_bytes -= sum(fused.pack.nbytes for fused in self._fused.values())
        self._fused.clear()

    def forwards_done(self) -> None:
        """The forwards of one scope are over: finish learning which linears share an input, and drop
        the activations held for it."""
        if self.fusion is not None:
            self.fusion.forwards_done()

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recompute_safe: bool = False
    ) -> torch.Tensor:
        """x [..., K], weight [N, K], bias [N] | None -> [..., N], like `F.linear`. Under autograd the
        gradients are ordinary GEMMs'; `recompute_safe` (gradient checkpointing on): see `_with_values`."""
        needs_grad = _needs_grad(x, weight, bias)
        # fusion is for bf16 row blocks only (see `_fused_pack_for`): fp32 calls skip its bookkeeping
        if self.fusion is not None and weight.dtype == torch.bfloat16 and not needs_grad and _eligible(weight, x):
            fused = self._fused_linear(x, weight, bias, self.fusion)
            if fused is not None:
                return fused
        pack = self._pack_for(weight, x, transposed=False)
        if pack is None:
            return original_linear(x, weight, bias)
        if needs_grad:
            if recompute_safe:
                return _with_values(original_linear(x, weight, bias), packed_matmul(x.detach(), pack, _detached(bias)))
            return _PackedLinearFunction.apply(x, weight, bias, pack, False)
        if self.fusion is not None and pack.row_blocks:
            self.fusion.observe(x, weight, bias)
        return packed_matmul(x, pack, bias)

    def ready_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`linear(x, weight, bias)` without its general checks, for the call a decode step makes most: an
        fp32 weight whose fixed-order panels are current, contiguous fp32 rows, no autograd. The same op
        on the same panels, so the same values. None for any other call (the caller runs `linear`, which
        packs or repacks first)."""
        if x.dtype != torch.float32 or not x.is_contiguous() or (bias is not None and bias.dtype != torch.float32):
            return None
        if _needs_grad(x, weight, bias):
            return None
        panels = self.ready_panels(weight)
        if panels is None:
            return None
        out = fixed_order_op()(x.view(-1, x.shape[-1]), panels, bias, weight.shape[0])
        return out.view(*x.shape[:-1], weight.shape[0])

    def ready_panels(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The fixed-order panels `[ceil(N / 32), K, 32]` of an fp32 `weight`, where they are current
        (made from this weight at its present version); else None."""
        pack = self._packs.get(id(weight))
        if pack is None or not pack.fixed_order or pack.unpacked or weight.dtype != torch.float32:
            return None
        if pack.owner() is not weight or pack.version != tensor_version(weight):
            return None
        return pack.packed

    def _fused_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fusion: LinearFusion
    ) -> torch.Tensor | None:
        """This call's columns of a fused GEMM: handed over (a group's member), or computed with the
        whole group's (its first weight); None for a call that runs its own GEMM."""
        columns = fusion.take(x, weight, bias)
        if columns is not None:
            return columns
        group = fusion.group_led_by(weight, bias)
        if group is None:
            return None
        fused = self._fused_pack_for(group)
        if fused is None:
            return None
        return fusion.hand_out(group, x, packed_matmul(x, fused.pack, fused.bias))

    def _fused_pack_for(self, group: FusedGroup) -> _FusedPack | None:
        """The group's concatenated weight packed (repacked after any member's update), or None, and
        the group given up, where fusing could change a value or the budget has no room."""
        pairs = group.live()
        if pairs is None:
            group.broken = True
            return None
        versions = tuple(tensor_version(t) for pair in pairs for t in pair if t is not None)
        fused = self._fused.get(id(group))
        if fused is not None and fused.versions == versions:
            return fused
        started = time.perf_counter()
        weights = [weight.detach() for weight, _ in pairs]
        dense, in_features = torch.cat(weights), weights[0].shape[1]  # [sum N_i, K]
        has_bias = pairs[0][1] is not None
        # bf16 row blocks only: there one block shape decides the probe. fp32 GEMMs are not fused: on
        # oneDNN a probe would need every row count (a slow probe per shape) and the decode step gains
        # nothing from it; on the fixed-order kernel fusing is exact by construction (each column its own
        # chain) but slows the step (its per-call cost is small, and the members' column views cost
        # downstream)
        agree = all(_bf16_blocks(weight) for weight in [dense, *weights]) and fused_columns_agree(
            in_features, tuple(group.out_features), has_bias
        )
        own = [self._packs[id(weight)] for weight, _ in pairs if id(weight) in self._packs]
        freed = own + ([fused.pack] if fused else [])
        held_after = self._held_bytes - sum(pack.nbytes for pack in freed) + dense.numel() * dense.element_size()
        if not agree or (self.budget_bytes is not None and held_after > self.budget_bytes):
            group.broken = True
            self._drop_fused(group)
            return None
        for weight, _ in pairs:
            self._packs.pop(id(weight), None)  # the members' own copies: the fused one serves them
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, ROW_BLOCK)
        small = bf16_small_blocks_agree(in_features, dense.shape[0])
        pack = Pack(weakref.ref(pairs[0][0]), versions[0], packed, True, small)
        bias = torch.cat([bias.detach() for _, bias in pairs if bias is not None]) if has_bias else None
        self._fused[id(group)] = fused = _FusedPack(pack, bias, versions)
        self._held_bytes = held_after
        self.packs_made += 1
        self.pack_ms += (time.perf_counter() - started) * 1e3
        return fused

    def _drop_fused(self, group: FusedGroup) -> None:
        fused = self._fused.pop(id(group), None)
        if fused is not None:
            self._held_bytes -= fused.pack.nbytes

    def addmm(
        self, bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recompute_safe: bool = False
    ) -> torch.Tensor:
        """bias [N] + x [M, K] @ weight [K, N]: GPT-2's `Conv1D` layers (weights stored transposed)."""
        pack = self._pack_for(weight, x, transposed=True)
        if pack is None:
            return original_addmm(bias, x, weight)
        if _needs_grad(x, weight, bias):
            if recompute_safe:
                return _with_values(original_addmm(bias, x, weight), packed_matmul(x.detach(), pack, bias.detach()))
            return _PackedLinearFunction.apply(x, weight, bias, pack, True)
        return packed_matmul(x, pack, bias)

    def _pack_for(self, weight: torch.Tensor, x: torch.Tensor, transposed: bool) -> Pack | None:
        if not _eligible(weight, x):
            return None
        pack, version = self._packs.get(id(weight)), tensor_version(weight)
        if pack is not None and pack.owner() is weight and pack.version == version:
            return pack
        started = time.perf_counter()
        dense = weight.detach().t().contiguous() if transposed else weight.detach()  # [N, K]
        row_blocks = _bf16_blocks(dense)
        fixed_order = not row_blocks and self.fixed_order
        if fixed_order and pack is not None and pack.fixed_order and pack.owner() is weight and (
            pack.packed.shape == panels_shape(*dense.shape) and pack.packed.dtype == panels_dtype(dense.dtype)
        ):  # a weight updated in place (an optimizer step): its panels rewritten where they are
            fixed_order_panels(dense, out=pack.packed)
            pack.version = version
            self.packs_made += 1
            self.pack_ms += (time.perf_counter() - started) * 1e3
            return pack
        # the GEMM's weight: bf16 for the row blocks and the fixed-order panels (widened as they are read);
        # oneDNN's fp32 GEMM takes bf16 as fp32 (exact): see the module docstring
        source = dense if row_blocks or fixed_order else dense.float()
        if pack is not None:
            del self._packs[id(weight)]
            self._held_bytes -= pack.nbytes
        size = panel_bytes(*source.shape, source.dtype) if fixed_order else source.numel() * source.element_size()
        small = row_blocks and bf16_small_blocks_agree(dense.shape[1], dense.shape[0])
        fp32_kernel = {"fixed_order": fixed_order, "out_features": dense.shape[0]}  # the Pack fields of the fp32 GEMM
        if self.budget_bytes is not None and self._held_bytes + size > self.budget_bytes:
            self.unpacked_calls += 1
            if fixed_order:  # no copy: the unpacked kernel reads the weight as it is (bf16 widened as read)
                fp32_kernel["unpacked"] = True
            elif row_blocks and x.numel() > ROW_BLOCK * x.shape[-1]:  # several blocks: reorder once, not per block
                source = torch.ops.mkldnn._reorder_linear_weight(source, ROW_BLOCK)
            return Pack(weakref.ref(weight), version, source, row_blocks, small, **fp32_kernel)  # this call only
        if fixed_order:
            packed = fixed_order_panels(source)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(source, ROW_BLOCK if row_blocks else 64)
        pack = Pack(weakref.ref(weight), version, packed, row_blocks, small, **fp32_kernel)
        self._packs[id(weight)] = pack
        self._held_bytes += pack.nbytes
        self.packs_made += 1
        self.pack_ms += (time.perf_counter() - started) * 1e3
        return pack


@dataclass
class _FusedPack:
    pack: Pack  # the concatenated [sum N_i, K] weight
    bias: torch.Tensor | None  # the concatenated biases
    versions: tuple  # every member weight's and bias's version when packed


def _bf16_blocks(dense: torch.Tensor) -> bool:
    """Whether a [N, K] weight runs oneDNN's bf16 GEMM in row blocks (else an fp32 GEMM)."""
    return dense.dtype == torch.bfloat16 and bf16_blocks_invariant(dense.shape[1], dense.shape[0])


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
    layer's forward during backward, where no linear is routed any more, and requires the same saved
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
        return packed_matmul(x, pack, bias)

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



def _eligible(weight: torch.Tensor, x: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu" and weight.dim() == 2 and x.dtype == weight.dtype and x.shape[-1] > 0
        and x.numel() > 0 and onednn_available(weight.dtype)
    )


def current_packs() -> PackedLinears | None:
    """The packs this thread's linears run on now (`packed_linears`), where the scope computes values only
    (no gradient checkpointing); else None."""
    route = active_linears()
    if isinstance(route, _Route) and not route.recompute_safe:
        return route.packs
    return None


class _Route:
    """What this thread's routed linear calls run on: `packs`, with the scope's `recompute_safe`."""

    def __init__(self, packs: PackedLinears, recompute_safe: bool) -> None:
        self.packs, self.recompute_safe = packs, recompute_safe

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.packs.linear(x, weight, bias, self.recompute_safe)

    def addmm(self, bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.packs.addmm(bias, x, weight, self.recompute_safe)

    def ready_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return self.packs.ready_linear(x, weight, bias)


@contextmanager
def packed_linears(packs: PackedLinears, recompute_safe: bool = False, conv1d: bool = False) -> Iterator[None]:
    """This thread's `F.linear` calls inside the block run on `packs` (and `Conv1D` addmm calls where
    `conv1d`: the model has such layers); `recompute_safe`: the model recomputes forwards in backward
    (gradient checkpointing), see `_with_values`."""
    try:
        with linears_on(_Route(packs, recompute_safe), conv1d):
            yield
    finally:
        packs.forwards_done()

