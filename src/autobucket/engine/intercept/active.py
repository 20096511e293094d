"""What this thread's forward runs: one frozen record in one context variable.

Every interceptor (the `F.linear` and dropout interceptors, transformers' "sdpa" dispatcher, the modeling
module's rotary / MLP / RMSNorm interceptors, the Conv1D mode, the trainer's position hook) and every
engine function that asks how to compute reads `active()`; the engine changes it only through
`forward_with`, which sets a copy with some fields changed for the block and restores the one before.
A context variable is per thread and per asyncio task, so another thread's forward reads its own
record (the default: nothing intercepted) while an engine call is in flight. Dynamo cannot read a
context variable: code that a graph may trace checks `torch.compiler.is_dynamo_compiling()` first."""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

_NO_OPS: Mapping[str, Callable] = MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class ActiveForward:
    """The plan's choices and the engine's per-forward overrides for this thread's forwards.

    - `plan`: the call's `ForwardPlan` (None outside an engine call or trainer scope);
    - `linears`: the object every intercepted linear goes to (`functions.LinearKernel`), None: the builtin;
    - `elementwise`: op family -> the function that replaces the modeling code's op ("rotary",
      "gated_mlp", "rms_norm"; see `modeling.py`), empty: the model's own code;
    - `kernel_attention`: the attention kernel this forward's attention calls run on, None: transformers' SDPA;
    - `step_attention`: the attention one engine step asked for (packed segments, shared-prefix or
      decode attention), ahead of `kernel_attention`;
    - `packing`: the packed prefill in progress (`packed_prefill`);
    - `windows`: masks are narrowed to each layer's sliding window;
    - `no_dropout`: dropout returns its input and SDPA runs without dropout;
    - `plain_no_grad`: autograd off through `torch.no_grad` rather than inference mode (`grad_mode`);
    - `triton_on_cpu`: CPU tensors run the Triton set (a test switch);
    - `graphs_on_cpu`: a CPU model's decode may take the captured form, on the traced stand-in for a CUDA
      graph (a test switch, `engine/decode/graph_capture.py`);
    - `position_models`: ids of the models whose forwards get positions counted over real tokens."""

    plan: Any = None
    linears: Any = None
    elementwise: Mapping[str, Callable] = dataclasses.field(default_factory=lambda: _NO_OPS)
    kernel_attention: Callable | None = None
    step_attention: Callable | None = None
    packing: Any = None
    windows: bool = False
    no_dropout: bool = False
    plain_no_grad: bool = False
    triton_on_cpu: bool = False
    graphs_on_cpu: bool = False
    position_models: frozenset[int] = frozenset()


# the default is frozen, so sharing it between threads is safe
_ACTIVE: contextvars.ContextVar[ActiveForward] = contextvars.ContextVar(
    "autobucket_forward", default=ActiveForward()  # noqa: B039
)


def active() -> ActiveForward:
    """This thread's (task's) record."""
    return _ACTIVE.get()


@contextmanager
def forward_with(**changes: Any) -> Iterator[ActiveForward]:
    """This thread's record with `changes` inside the block, the one before after it (even on error)."""
    token = _ACTIVE.set(dataclasses.replace(_ACTIVE.get(), **changes))
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)
