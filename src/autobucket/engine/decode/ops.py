"""The ops one decode step calls, as one record, and the one function that decides which run.

`DecodeOps` holds one callable per op of the Llama-family step (`step.py`). Two sets fill it:

- the model's modules (`module_ops`): each leaf called as the model's forward calls it (LoRA layers
  included, so the active adapters run), the attention through the engine's dispatcher, which runs this
  thread's attention (an override such as shared-prefix attention, the invariant kernel, or
  transformers' SDPA). Bitwise the model's forward on the same kernels, wherever the step may run.
- the engine's kernels straight (`kernel_ops`): under `kernels="invariant"` every leaf of an fp32 step
  already reaches one of the engine's kernels through the model's modules and the routers; here each is
  called on its kernel (the fixed-order linear on its ready panels, the fused RMSNorm, rotary and
  SiLU-and-multiply, the invariant attention) with the same inputs, checked once per step rather than
  per call. Taken only where nothing can tell the difference (`kernel_ops` says where).

A compiled step runs a third set, `graph_ops` (module calls dynamo traces, a graph-safe attention).
`decode_ops` is the single place that chooses among them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autobucket.engine.decode.parts import LlamaParts
from autobucket.engine.intercept.attention import (
    chosen_attention,
    dispatch_sdpa,
    windows_applied,
    within_window,
)
from autobucket.engine.intercept.elementwise import fused_here
from autobucket.engine.intercept.functions import call_linear, call_unobserved, dropout_suppressed
from autobucket.engine.kernels.elementwise import gated_mlp, rms_norm, rotary
from autobucket.engine.kernels.invariant_attention import allowed_for, invariant_sdpa
from autobucket.engine.kernels.library import kernel_library_builds
from autobucket.engine.kernels.packed_linear import current_packs
from autobucket.engine.kernels.packed_matmul import fixed_order_op
from autobucket.engine.kernels.shared_prefix_attention import SharedPrefixAttention, SharedPrefixLayout

Tensor = torch.Tensor
# (layer index, the layer's attention module, query [rows, heads, 1, head_dim], key / value [rows, kv_heads,
# columns, head_dim]) -> output [rows, 1, heads, head_dim]
AttentionOp = Callable[[int, Any, Tensor, Tensor, Tensor], Tensor]

MODULES, KERNELS = "modules", "kernels"  # `DecodeOps.source`


@dataclass(frozen=True)
class DecodeOps:
    """One decode step's ops; `source` names the set (MODULES or KERNELS)."""

    source: str
    linear: Callable[[torch.nn.Module, Tensor], Tensor]  # (a linear layer, x [..., in]) -> [..., out]
    rms_norm: Callable[[torch.nn.Module, Tensor], Tensor]  # (an RMSNorm, x [..., hidden]) -> x's shape
    rotary: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]  # (q, k, cos, sin) -> (q, k)
    gated_mlp: Callable[[torch.nn.Module, Tensor], Tensor]  # (the layer's MLP, x [..., hidden]) -> [..., hidden]
    attention: AttentionOp  # over each row's own cache columns
    shared_prefix_attention: AttentionOp  # over a shared prefix's K/V first, then the row's own columns


def decode_ops(
    parts: LlamaParts, mask: Tensor | None, position_ids: Tensor,
    graph_attention: Callable[..., tuple[Tensor, Any]] | None = None,
) -> DecodeOps:
    """This step's ops: inside a compiled graph (`graph_attention` given: its attention) the graph ops;
    else, from the thread's state now, the engine's kernels straight where every op would reach them
    anyway (`kernel_ops`), else the model's modules. mask: the step's 4-D additive mask (None where no row
    is masked); position_ids [rows, 1]."""
    if graph_attention is not None:
        return graph_ops(parts, mask, graph_attention)
    return kernel_ops(parts, mask) or module_ops(parts, mask, position_ids)


# ------------------------------------------------------------------ the model's modules
def module_ops(parts: LlamaParts, mask: Tensor | None, position_ids: Tensor) -> DecodeOps:
    """Each op as the model's forward calls it; the attention through the dispatcher, with the keywords
    the model's attention hands it (its `position_ids`, `use_cache` and a sliding layer's window, which
    the dispatcher uses to narrow the mask of a call past the window)."""

    def attention(index: int, module: Any, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        keywords: dict[str, Any] = {"position_ids": position_ids, "use_cache": True}
        if parts.window_keyword[index]:
            keywords["sliding_window"] = parts.layer_window(module)
        output, _ = dispatch_sdpa(
            module,
            query,
            key,
            value,
            mask,
            dropout=0.0 if not module.training else module.attention_dropout,
            scaling=module.scaling,
            **keywords,
        )
        return output

    return DecodeOps(
        source=MODULES,
        linear=call_linear,
        rms_norm=lambda norm, x: norm(x),
        # looked up at each call: while a call is in flight that may be the fused rotary's router
        rotary=lambda q, k, cos, sin: parts.modeling.apply_rotary_pos_emb(q, k, cos, sin),
        # the class's forward: transformers' own, or the fused product's router in front of it
        gated_mlp=lambda mlp, x: type(mlp).forward(mlp, x),
        attention=attention,
        shared_prefix_attention=attention,  # this thread's override (`SharedPrefixAttention`) via the dispatcher
    )


# ------------------------------------------------------------------ inside a compiled graph
def graph_ops(parts: LlamaParts, mask: Tensor | None, attention: Callable[..., tuple[Tensor, Any]]) -> DecodeOps:
    """The ops of the step compiled over static shapes: each leaf a module call (dynamo traces the
    module's forward, the routers stand aside while it traces), `attention` (transformers' attention
    interface, graph-safe) over the step's bucket of columns with `mask` [rows, 1, 1, columns]."""

    def attend(index: int, module: Any, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return attention(module, query, key, value, mask, scaling=module.scaling)[0]

    return DecodeOps(
        source=MODULES,
        linear=lambda linear, x: linear(x),
        rms_norm=lambda norm, x: norm(x),
        rotary=lambda q, k, cos, sin: parts.modeling.apply_rotary_pos_emb(q, k, cos, sin),
        gated_mlp=lambda mlp, x: mlp(x),
        attention=attend,
        shared_prefix_attention=attend,  # a compiled call shares no prefix (`ModelRunner`)
    )


# ------------------------------------------------------------------ the engine's kernels straight
def kernel_ops(parts: LlamaParts, mask: Tensor | None) -> DecodeOps | None:
    """The kernel ops, or None where a call through the modules could reach another kernel: the thread
    must run the invariant kernels (the packed linears' route, the invariant attention or the invariant
    shared-prefix attention, the fused elementwise routers in place), the model be fp32, every bypassed
    module the plain one with no hooks, no forward replaced, every linear's panels current (after a weight
    update the module ops run once and repack), no gradient wanted and no attention dropout to apply."""
    if not kernel_library_builds():
        return None
    packs = current_packs()
    chosen = chosen_attention()
    layout = chosen.layout if isinstance(chosen, SharedPrefixAttention) and chosen.invariant else None
    on_kernel_attention = chosen is invariant_sdpa or layout is not None
    if packs is None or torch.is_grad_enabled() or not on_kernel_attention or not _leaves_on_kernels(parts):
        return None
    panels = {id(linear): packs.ready_panels(linear.weight) for linear in parts.linears}
    if any(panel is None for panel in panels.values()):  # a weight to pack or repack: the module ops do it
        return None
    return _KernelCalls(parts, panels, mask, layout).ops()


def _leaves_on_kernels(parts: LlamaParts) -> bool:
    """Whether each bypassed call would reach the kernel the kernel ops call: the routers in, the plain
    modules without hooks, fp32 parameters, no dropout to apply (the attention is checked by the caller)."""
    routed = fused_here() and rotary.routed(parts.modeling.apply_rotary_pos_emb)
    if not (routed and rms_norm.available() and gated_mlp.available()) or parts.lm_head.weight.dtype != torch.float32:
        return False
    plain_linears = all(
        type(linear) is torch.nn.Linear
        and call_unobserved(linear)
        and (linear.bias is None or linear.bias.dtype == torch.float32)
        for linear in parts.linears
    )
    plain_norms = all(rms_norm.routed_module(norm) and call_unobserved(norm) for norm in parts.norms)
    plain_mlps = all(gated_mlp.routed_module(mlp) and call_unobserved(mlp) for mlp in parts.mlps)
    no_dropout = all(
        not layer.self_attn.training or not layer.self_attn.attention_dropout or dropout_suppressed()
        for layer in parts.layers
    )
    return plain_linears and plain_norms and plain_mlps and no_dropout


class _KernelCalls:
    """One step's kernel calls: each linear on its ready panels, the attention on the mask's allowed keys
    (made once per step and window), after the shared prefix's keys in a shared-prefix step."""

    def __init__(
        self, parts: LlamaParts, panels: dict[int, Tensor], mask: Tensor | None, layout: SharedPrefixLayout | None
    ) -> None:
        self.parts, self.panels, self.mask, self.layout = parts, panels, mask, layout
        self.windows = windows_applied()  # a call past the model's sliding window narrows sliding layers
        self.allowed: dict[int, Tensor] = {}  # window (0: none) -> the step's allowed keys
        self.fixed_order = fixed_order_op()

    def ops(self) -> DecodeOps:
        return DecodeOps(
            KERNELS, self.linear, _rms_norm, self.rotary, self.gated_mlp, self.attention, self.shared_prefix_attention
        )

    def linear(self, linear: torch.nn.Linear, x: Tensor) -> Tensor:
        """x [..., K] contiguous -> [..., N] on the linear's panels (`PackedLinears.ready_linear`'s op)."""
        out = self.fixed_order(x.view(-1, x.shape[-1]), self.panels[id(linear)], linear.bias, linear.out_features)
        return out.view(*x.shape[:-1], linear.out_features)

    def rotary(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """The fused kernel where it takes the call; else the router, which then runs the function it fronts."""
        if rotary.kernel_takes(q, k, cos, sin, (), {}):
            return rotary.fused_rotary_embedding(q, k, cos, sin)
        return self.parts.modeling.apply_rotary_pos_emb(q, k, cos, sin)

    def gated_mlp(self, mlp: Any, x: Tensor) -> Tensor:
        gate, up = self.linear(mlp.gate_proj, x), self.linear(mlp.up_proj, x)
        return self.linear(mlp.down_proj, gated_mlp.silu_and_mul(gate, up))

    def attention(self, index: int, module: Any, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """The invariant kernel over each row's allowed keys."""
        allowed = self._allowed(module, query.shape[0], key)
        return torch.ops.autobucket.invariant_attention(query, key, value, allowed, False, float(module.scaling))

    def shared_prefix_attention(self, index: int, module: Any, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """The invariant kernel over the row's group's shared keys, those its window covers, then its own
        (`SharedPrefixAttention`'s invariant call, counted as the runner checks)."""
        layout, layer = self.layout, module.layer_idx
        allowed = self._allowed(module, query.shape[0], key)
        output = torch.ops.autobucket.invariant_attention_shared(
            query,
            key,
            value,
            allowed,
            float(module.scaling),
            layout.keys[layer],
            layout.values[layer],
            layout.shared_length,
            layout.row_group,
            layout.shared_tiles(layer),
            self._window(module),
        )
        layout.calls += 1
        return output

    def _window(self, module: Any) -> int:
        return (self.parts.layer_window(module) or 0) if self.windows else 0

    def _allowed(self, module: Any, rows: int, key: Tensor) -> Tensor:
        window = self._window(module)
        if window not in self.allowed:
            mask = within_window(self.mask, window, 1, key.shape[2], key.device) if window else self.mask
            self.allowed[window] = allowed_for(mask, rows, key.shape[2])
        return self.allowed[window]


def _rms_norm(norm: Any, x: Tensor) -> Tensor:
    """The RMSNorm's fused kernel, as its router runs it."""
    return rms_norm.rms_norm(x, norm.weight, norm.variance_epsilon)
