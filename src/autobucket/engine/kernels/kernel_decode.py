"""The direct decode step with every part called straight on the engine's kernels.

Under `kernels="invariant"`, every leaf of an fp32 Llama-family decode step already reaches one of the
engine's kernels: each linear the fixed-order panels (`packed_linear.py`), each RMSNorm, the rotary
embedding and the MLP's SiLU-and-multiply their fused kernels (`elementwise/`), the attention the
invariant kernel. `DirectDecode` still reaches them through the model's modules, the routers and each
kernel's checks, per layer: a visible share of a small model's step (`benchmarks/kernels/decode_step.py`).
`KernelDecode.step` calls the same ops with the same inputs in the direct step's order,
so its logits are bitwise the direct step's (tested per architecture, with the direct step as the
oracle), and checks once per step what the routers check per call.

A cascade step (rows reading a shared prompt's one copy of K/V, `cascade_attention.py`) is taken too: its
attention is the cascade's own invariant call, `invariant_attention_shared` on the step's layout. A GRPO-like
call runs every step so (`benchmarks/kernels/cascade_kernel_step.py` compares it with the direct step): the
step's Python weighs more as the kernels split among threads.

A call past the model's sliding window (Mistral, Qwen2/3 with `use_sliding_window`) is taken too: each
sliding layer's allowed keys are narrowed as the dispatcher narrows the direct step's mask
(`within_window`, once per window and step), and a cascade step passes the window to the cascade's kernel.

It takes a step only where nothing can tell the difference: the thread runs the invariant kernels (the
packed linears' route, the invariant attention or the invariant cascade, the fused elementwise routers in
place), the model is fp32, every bypassed module is the plain one with no hooks (`call_unobserved`), no
forward replaced, every linear's panels are current (after a weight update the direct step runs once and
repacks), and no attention dropout. Otherwise `step` returns None and the caller runs the direct step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autobucket.engine.intercept.attention import chosen_attention, windows_applied, within_window
from autobucket.engine.intercept.elementwise import fused_here
from autobucket.engine.intercept.functions import call_unobserved, dropout_suppressed
from autobucket.engine.kernels.cascade_attention import CascadeAttention, CascadeLayout
from autobucket.engine.kernels.elementwise import gated_mlp, rms_norm, rotary
from autobucket.engine.kernels.invariant_attention import allowed_for, invariant_sdpa
from autobucket.engine.kernels.library import kernel_library_builds
from autobucket.engine.kernels.packed_linear import current_packs
from autobucket.engine.kernels.packed_matmul import fixed_order_op
from autobucket.engine.model_access.direct_decode import DirectDecode, KeyValueWrite

_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


class KernelDecode:
    """One decode forward of an fp32 Llama-family model straight on the engine's kernels (module docstring)."""

    def __init__(self, direct: DirectDecode) -> None:
        self.direct = direct
        self.model, self.inner, self.layers = direct.model, direct.inner, direct.layers
        self.linears = [
            *(getattr(part, name) for layer in self.layers
              for part, names in ((layer.self_attn, _ATTENTION_PARTS), (layer.mlp, _MLP_PARTS)) for name in names),
            self.model.lm_head,
        ]
        qk_norms = [(layer.self_attn.q_norm, layer.self_attn.k_norm) for layer in self.layers] if direct.qk_norm else []
        self.norms = [
            *(norm for layer in self.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)),
            *(norm for pair in qk_norms for norm in pair),
            self.inner.norm,
        ]
        self.mlps = [layer.mlp for layer in self.layers]

    @classmethod
    def of(cls, direct: DirectDecode | None) -> KernelDecode | None:
        """The kernel step behind `direct`, or None where the kernel library does not build."""
        if direct is None or not kernel_library_builds():
            return None
        return cls(direct)

    def step(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        write: KeyValueWrite,
    ) -> torch.Tensor | None:
        """`DirectDecode.step`'s logits [rows, 1, vocab], or None where this step must run the direct step."""
        packs = current_packs()
        attention = chosen_attention()
        cascade = attention.layout if isinstance(attention, CascadeAttention) and attention.invariant else None
        on_kernel_attention = attention is invariant_sdpa or cascade is not None
        if packs is None or torch.is_grad_enabled() or not on_kernel_attention or not self._leaves_on_kernels():
            return None
        panels = [packs.ready_panels(linear.weight) for linear in self.linears]
        if any(panel is None for panel in panels):  # a weight to pack or repack: the direct step does it
            return None
        hidden = self.inner.embed_tokens(input_ids)  # [rows, 1, hidden]
        cos, sin = self.inner.rotary_emb(hidden, position_ids)
        calls = _Calls(self.linears, panels, attention_mask, cascade, self.direct.layer_window if windows_applied() else None)
        for index, layer in enumerate(self.layers):
            residual = hidden
            attended = calls.attention(index, layer.self_attn, _norm(layer.input_layernorm, hidden), cos, sin, write)
            if attended is None:  # (only in the first layer, before anything was written)
                return None
            hidden = residual + attended
            residual = hidden
            hidden = calls.gated_mlp(_norm(layer.post_attention_layernorm, hidden))
            hidden = residual + hidden
        return calls.linear(_norm(self.inner.norm, hidden)[:, 0:, :])  # the head

    def _leaves_on_kernels(self) -> bool:
        """Whether each bypassed call would reach the kernel this step calls: the routers in, the plain
        modules without hooks, fp32 parameters, no dropout to apply (the attention is checked by `step`)."""
        modeling_rotary = self.direct.modeling.apply_rotary_pos_emb
        routed = fused_here() and rotary.routed(modeling_rotary) and rms_norm.available() and gated_mlp.available()
        if not routed or self.model.lm_head.weight.dtype != torch.float32:
            return False
        plain_linears = all(
            type(linear) is torch.nn.Linear and call_unobserved(linear)
            and (linear.bias is None or linear.bias.dtype == torch.float32)
            for linear in self.linears
        )
        plain_norms = all(rms_norm.routed_module(norm) and call_unobserved(norm) for norm in self.norms)
        plain_mlps = all(gated_mlp.routed_module(mlp) and call_unobserved(mlp) for mlp in self.mlps)
        no_dropout = all(
            not layer.self_attn.training or not layer.self_attn.attention_dropout or dropout_suppressed()
            for layer in self.layers
        )
        return plain_linears and plain_norms and plain_mlps and no_dropout


def _norm(norm: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The RMSNorm's fused kernel, as its router runs it."""
    return rms_norm.rms_norm(hidden, norm.weight, norm.variance_epsilon)


class _Calls:
    """One step's kernel calls: the linears in the model's order on their ready panels, the attention on
    the mask's allowed keys (made once per step and window), after the shared prompts' keys in a cascade
    step. `layer_window`: in a call past the model's sliding window, a layer's window (None: full
    attention), which narrows its allowed keys as the dispatcher narrows the mask; None: no windows."""

    def __init__(
        self,
        linears: list[torch.nn.Linear],
        panels: list[torch.Tensor | None],
        mask: torch.Tensor | None,
        cascade: CascadeLayout | None,
        layer_window: Callable[[Any], int | None] | None = None,
    ) -> None:
        self.linears, self.panels, self.mask, self.cascade = linears, panels, mask, cascade
        self.layer_window = layer_window
        self.next = 0  # the next linear, in the model's order
        self.allowed: dict[int, torch.Tensor] = {}  # window (0: none) -> the step's allowed keys
        self.fixed_order = fixed_order_op()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] contiguous -> [..., N] on the next linear's panels (`PackedLinears.ready_linear`'s op)."""
        linear, panels = self.linears[self.next], self.panels[self.next]
        self.next += 1
        out = self.fixed_order(x.view(-1, x.shape[-1]), panels, linear.bias, linear.out_features)
        return out.view(*x.shape[:-1], linear.out_features)

    def attention(
        self, index: int, attention: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write: KeyValueWrite
    ) -> torch.Tensor | None:
        """`DirectDecode._attention` on the kernels: projections, rotary, cache write, attention, output
        projection; None where the rotary kernel would not take the call (checked in the first layer)."""
        rows = hidden.shape[0]
        hidden_shape = (rows, 1, -1, attention.head_dim)  # [rows, 1, heads, head_dim]
        query, key = self.linear(hidden).view(hidden_shape), self.linear(hidden).view(hidden_shape)
        if hasattr(attention, "q_norm"):  # Qwen3: per-head RMSNorms before the rotary embedding
            query, key = _norm(attention.q_norm, query), _norm(attention.k_norm, key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = self.linear(hidden).view(hidden_shape).transpose(1, 2)
        if index == 0 and not rotary.kernel_takes(query, key, cos, sin, (), {}):
            return None
        query, key = rotary.fused_rotary_embedding(query, key, cos, sin)
        key, value = write(attention.layer_idx, key, value)
        window = (self.layer_window(attention) or 0) if self.layer_window is not None else 0
        if window not in self.allowed:
            mask = within_window(self.mask, window, 1, key.shape[2], key.device) if window else self.mask
            self.allowed[window] = allowed_for(mask, rows, key.shape[2])
        output = self._attend(attention, query, key, value, self.allowed[window], window)
        return self.linear(output.reshape(rows, 1, -1).contiguous())  # o_proj

    def _attend(self, attention: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                allowed: torch.Tensor, window: int) -> torch.Tensor:
        """The invariant kernel the step's attention function calls: over each row's allowed keys, or in a
        cascade step over its group's shared keys first, those its window covers (`CascadeAttention`'s
        invariant call, counted as the runner checks)."""
        scale = float(attention.scaling)
        if self.cascade is None:
            return torch.ops.autobucket.invariant_attention(query, key, value, allowed, False, scale)
        layout, layer = self.cascade, attention.layer_idx
        output = torch.ops.autobucket.invariant_attention_shared(
            query, key, value, allowed, scale, layout.keys[layer], layout.values[layer], layout.shared_length,
            layout.row_group, layout.shared_tiles(layer), window,
        )
        layout.calls += 1
        return output

    def gated_mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        gate = self.linear(hidden)
        up = self.linear(hidden)
        return self.linear(gated_mlp.silu_and_mul(gate, up))
