"""Which linears read the same input, learned from the forwards themselves, so they run as one GEMM.

A decoder layer's q, k and v projections read one normed hidden state, and so do its gate and up
projections (a LoRA layer's `lora_A` reads its base layer's input too). Run as one GEMM on the
concatenated weight, each call pays oneDNN's per-call cost and the wrapper's Python once instead of
two or three times, which on a small model's decode step is a large share of each GEMM's time
(`benchmarks/kernels/fused_linears.py`). The model is not changed and nothing is assumed about its module
names: the engine watches which weights each input tensor meets (`observe`), and a weight that met
the same input as the ones before it becomes a member of that input's group. From the next forward
on, the group's first weight runs the fused GEMM (`PackedLinears`) and hands its members their
columns (`take`), which are bitwise what their own GEMMs give (`fused_columns_agree` probes each
group's shapes first), so fusing never changes a value: the trainer's scope runs them unfused.

If a forward calls a member with another input than its group's first weight got (a model whose
calls differ from the forward it was learned on), the member runs its own GEMM and the group is
dropped for good (`broken`)."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from autobucket.engine.model_access.weight_versions import in_place_version as _version

RECENT_INPUTS = 4  # inputs watched at once: a LoRA layer's lora_B reads another input between q, k and v


def _same(ref: weakref.ref | None, tensor: torch.Tensor | None) -> bool:
    """Whether `ref` (None for no tensor) refers to `tensor` (None for none)."""
    return ref is None if tensor is None else ref is not None and ref() is tensor


@dataclass
class FusedGroup:
    """Linears that read one input: `weights[0]` runs the GEMM for all; `out_features` in call order."""

    weights: list[weakref.ref]  # [N_i, K] each
    biases: list[weakref.ref | None]  # all None, or all set
    out_features: list[int]
    broken: bool = False

    def live(self) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
        """The (weight, bias) pairs, or None once any of them is freed."""
        pairs = []
        for weight_ref, bias_ref in zip(self.weights, self.biases, strict=True):
            weight, bias = weight_ref(), None if bias_ref is None else bias_ref()
            if weight is None or (bias_ref is not None and bias is None):
                return None
            pairs.append((weight, bias))
        return pairs


@dataclass
class _Seen:
    """One input tensor and the (weight, bias) pairs it met, in call order."""

    x: torch.Tensor
    version: int | None
    calls: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)


@dataclass
class _Handed:
    """A member's columns of a fused GEMM, waiting for its call on the same input."""

    x: torch.Tensor
    version: int | None
    group: FusedGroup
    index: int  # the member's place in its group
    columns: torch.Tensor


class LinearFusion:
    """The groups learned so far, the inputs being watched, and the columns handed out."""

    def __init__(self) -> None:
        self._groups: dict[int, FusedGroup] = {}  # id(first weight) -> its group
        self._members: dict[int, FusedGroup] = {}  # id(other weights) -> their group
        self._recent: OrderedDict[int, _Seen] = OrderedDict()  # id(x) -> what it met (holds x alive)
        self._handed: dict[int, _Handed] = {}  # id(member weight) -> its columns
        self.fused_calls = 0

    @property
    def groups(self) -> list[FusedGroup]:
        return [group for group in self._groups.values() if not group.broken]

    def group_led_by(self, weight: torch.Tensor, bias: torch.Tensor | None) -> FusedGroup | None:
        group = self._groups.get(id(weight))
        if group is None or group.broken or not _same(group.weights[0], weight) or not _same(group.biases[0], bias):
            return None
        return group

    def hand_out(self, group: FusedGroup, x: torch.Tensor, fused: torch.Tensor) -> torch.Tensor:
        """Split a fused output [..., sum N_i] into its members' columns: the first weight's returned,
        the others kept for their calls on `x`."""
        columns = torch.split(fused, group.out_features, dim=-1)  # views: copies cost more than the GEMM saved
        version = _version(x)
        for index in range(1, len(columns)):
            self._handed[id(group.weights[index]())] = _Handed(x, version, group, index, columns[index])
        self.fused_calls += 1
        return columns[0]

    def take(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The columns a fused GEMM computed for this call, or None (then the call runs its own GEMM);
        a member of a group called on another input breaks its group."""
        group = self._members.get(id(weight))
        if group is None or group.broken:
            return None
        handed = self._handed.pop(id(weight), None)
        if (
            handed is not None and handed.group is group and handed.x is x and handed.version == _version(x)
            and _same(group.weights[handed.index], weight) and _same(group.biases[handed.index], bias)
        ):
            return handed.columns
        group.broken = True
        return None

    def observe(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Note that `weight` (with `bias`) met input `x` in an unfused call."""
        seen = self._recent.get(id(x))
        if seen is not None and seen.x is x and seen.version == _version(x):
            seen.calls.append((weight, bias))
            self._recent.move_to_end(id(x))
            return
        if seen is not None:
            self._learn(self._recent.pop(id(x)))
        self._recent[id(x)] = _Seen(x, _version(x), [(weight, bias)])
        if len(self._recent) > RECENT_INPUTS:
            self._learn(self._recent.popitem(last=False)[1])

    def forwards_done(self) -> None:
        """Learn from the inputs still watched and let go of every activation held."""
        while self._recent:
            self._learn(self._recent.popitem(last=False)[1])
        self._handed.clear()

    def _learn(self, seen: _Seen) -> None:
        if len({id(weight) for weight, _ in seen.calls}) < len(seen.calls):
            return  # a weight met the input twice: not a set of projections
        if any(id(weight) in self._groups or id(weight) in self._members for weight, _ in seen.calls):
            return  # already grouped (or broken): never regroup
        kinds: dict[tuple, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        for weight, bias in seen.calls:  # one GEMM needs one dtype and input width, and biases for all or none
            if weight.dim() == 2:
                kinds.setdefault((weight.dtype, weight.shape[1], bias is None), []).append((weight, bias))
        for calls in kinds.values():
            if len(calls) > 1:
                self._group(calls)

    def _group(self, calls: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        group = FusedGroup(
            [weakref.ref(weight) for weight, _ in calls],
            [None if bias is None else weakref.ref(bias) for _, bias in calls],
            [weight.shape[0] for weight, _ in calls],
        )
        self._groups[id(calls[0][0])] = group
        for weight, _ in calls[1:]:
            self._members[id(weight)] = group

