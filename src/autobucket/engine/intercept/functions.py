"""How this thread's forwards reach the engine's linears and eval-mode dropout: a few `torch.nn.functional`
functions replaced, while an engine call is in flight, by interceptors that read context variables.

- `F.linear` goes to the scope's `LinearKernel` (the packed, batch-invariant linears of
  `kernels="invariant"` and `autobucket.invariant`); so does transformers' `Conv1D` (`torch.addmm` on a
  transposed parameter) for models that have one, through `Conv1dAddmmMode`, a `TorchFunctionMode`:
  `torch.addmm` itself is not replaced, since inductor binds `torch.addmm` as an extern kernel when it
  is first imported;
- dropout (`F.dropout` and its kin) returns its input, and `F.scaled_dot_product_attention` runs with
  `dropout_p = 0`, under `eval_semantics` (a model handed over in train mode, `training` untouched).

Why not a `TorchFunctionMode`: a mode sees every torch call of the thread, not only these, and its
per-call cost over a decode step's hundreds of torch calls outweighs every linear's wrapper together
(docs/kernels.md). An interceptor costs a context-variable read, and only on its own function's calls.

What the interceptors reach: calls that look the function up when they run — `nn.Linear.forward`
(`F.linear(...)`, so LoRA layers' base and adapter linears too), `nn.Dropout.forward`, attention and
dropout calls through `nn.functional.`, and `torch.nn.functional`'s own callers. Code that bound one of these names before the interceptors went in
keeps the builtin (for a linear: the model's own kernel, not batch-invariant; the zero-mismatch tests
check the architectures it runs). Nothing on the model changes; other threads get the builtins (one
context-variable read more while the interceptors are in). The interceptors go in when the first scope of the
process opens and come out when the last one closes; a replacement someone else made meanwhile is left
alone. Under torch.compile's tracing (dynamo cannot read a context variable) the linear interceptor calls
the builtin and the dropout interceptors read `_traced_dropout_off`, a module global dynamo guards on, which
the engine's compiled decode step sets around its graph call (`compiled_dropout_off`): the graph is
traced without dropout and costs nothing per op at run time. (A `TorchFunctionMode` around the graph
call, what this replaced, was not consulted for a dropout reached through an interceptor, measured.)"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.nn.modules import module as module_globals
from torch.overrides import TorchFunctionMode

from autobucket.engine.intercept.active import active, forward_with

# the builtins, for the engine's own calls and for every call outside a engine call
original_linear: Callable[..., torch.Tensor] = F.linear
original_addmm: Callable[..., torch.Tensor] = torch.addmm  # never replaced: the name stays the builtin
_DROPOUT_NAMES = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")
_ORIGINAL_DROPOUTS = {name: getattr(F, name) for name in _DROPOUT_NAMES}
_ORIGINAL_SDPA = F.scaled_dot_product_attention


class LinearKernel(Protocol):
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def addmm(self, bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def ready_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`linear`'s values for a call its quick path takes (a weight already prepared, no autograd), else
        None: then the caller runs the linear the ordinary way."""
        ...


_LOCK = threading.Lock()  # guards _OPEN_SCOPES and the replacements
_OPEN_SCOPES = 0
_traced_dropout_off = False  # what the dropout interceptors do while dynamo traces (`compiled_dropout_off`)
_COMPILE_LOCK = threading.RLock()  # one compiled step at a time while it sets _traced_dropout_off


def _tracing() -> bool:
    # Not `is_compiling()`: torch holds that True for every thread through a compile session, which
    # would send another thread's eager forward down the traced path (builtin linears, another dropout).
    return torch.compiler.is_dynamo_compiling()


def _intercepted_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    route = None if _tracing() else active().linears
    if route is None:
        return original_linear(input, weight, bias)
    return route.linear(input, weight, bias)


def active_linears() -> LinearKernel | None:
    """The linear route of this thread's forwards (None: outside a scope, or under dynamo's tracing)."""
    return None if _tracing() else active().linears


_LINEAR_FORWARD = torch.nn.Linear.forward


def call_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`, for the engine's own calls of a model's linear layers (the direct decode step, the
    fused MLP): a plain `nn.Linear` whose call nothing can observe goes straight to this thread's linear
    route's quick path, skipping the module call, `Linear.forward` and the `F.linear` interceptor (a
    visible share of a small model's decode step: Python per linear, every layer).
    The values are the route's, which is what `module(x)` reaches. Anything else — a LoRA layer, a
    subclass, a replaced forward, hooks (the module's or global ones: `Module.__call__` skips them only
    when there are none), no route, a call the quick path does not take — is `module(x)`."""
    route = active_linears()
    if route is not None and type(module) is torch.nn.Linear and call_unobserved(module):
        out = route.ready_linear(x, module.weight, module.bias)
        if out is not None:
            return out
    return module(x)


def call_unobserved(module: torch.nn.Module) -> bool:
    """Whether `module(...)` is exactly its class's forward: no hooks of any kind (the module's or global
    ones, as `Module._call_impl` checks them), no forward set on the instance, and for an `nn.Linear`
    the class's own forward."""
    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or module_globals._global_forward_hooks
        or module_globals._global_forward_pre_hooks
        or module_globals._global_backward_hooks
        or module_globals._global_backward_pre_hooks
        or "forward" in module.__dict__
        or (isinstance(module, torch.nn.Linear) and torch.nn.Linear.forward is not _LINEAR_FORWARD)
    )


class Conv1dAddmmMode(TorchFunctionMode):
    """The `Conv1D` addmm calls of this thread's forwards to `route` (models with `Conv1D` layers only:
    a mode sees every torch call, see the module docstring)."""

    def __init__(self, route: LinearKernel) -> None:
        super().__init__()
        self.route = route

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is original_addmm and is_conv1d_call(args, kwargs):
            return self.route.addmm(*args)
        return func(*args, **(kwargs or {}))


def _dropout_interceptor(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def routed(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _traced_dropout_off if _tracing() else active().no_dropout:
            return args[0] if args else kwargs["input"]
        return original(*args, **kwargs)

    routed.__name__ = routed.__qualname__ = f"routed_{original.__name__}"
    return routed


def _without_dropout_p(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if len(args) > 4:  # positional dropout_p
        return (*args[:4], 0.0, *args[5:]), kwargs
    return args, {**kwargs, "dropout_p": 0.0}


def _intercepted_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
    if _traced_dropout_off if _tracing() else active().no_dropout:
        args, kwargs = _without_dropout_p(args, kwargs)
    return _ORIGINAL_SDPA(*args, **kwargs)


_INTERCEPTORS: list[tuple[Any, str, Callable, Callable]] = [  # (module, name, builtin, interceptor)
    (F, "linear", original_linear, _intercepted_linear),
    (F, "scaled_dot_product_attention", _ORIGINAL_SDPA, _intercepted_sdpa),
    *((F, name, builtin, _dropout_interceptor(builtin)) for name, builtin in _ORIGINAL_DROPOUTS.items()),
]


def is_conv1d_call(args: tuple, kwargs: dict | None) -> bool:
    """`torch.addmm(bias, x, weight)` as transformers' `Conv1D` calls it: a parameter as the weight,
    beta = alpha = 1 (other addmm calls are left alone)."""
    return (
        not kwargs
        and len(args) == 3
        and isinstance(args[2], torch.nn.Parameter)
        and args[1].dim() == 2
        and args[0].dim() == 1
    )


def interceptors_installed() -> bool:
    return F.linear is _intercepted_linear


@contextmanager
def _interceptors_in() -> Iterator[None]:
    global _OPEN_SCOPES
    with _LOCK:
        if _OPEN_SCOPES == 0:
            for module, name, _, interceptor in _INTERCEPTORS:
                setattr(module, name, interceptor)
        _OPEN_SCOPES += 1
    try:
        yield
    finally:
        with _LOCK:
            _OPEN_SCOPES -= 1
            if _OPEN_SCOPES == 0:
                for module, name, builtin, interceptor in _INTERCEPTORS:
                    if getattr(module, name) is interceptor:
                        setattr(module, name, builtin)


def builtin_behind(function: Callable) -> Callable:
    """The function a `function_replaced` interceptor stands in front of (`function` itself if it is none)."""
    return getattr(function, "_autobucket_builtin", function)


_REPLACED: dict[tuple[int, str], int] = {}  # (id(module), name) -> open scopes, for `function_replaced`


@contextmanager
def function_replaced(module: Any, name: str, builtin: Callable, interceptor: Callable) -> Iterator[None]:
    """`module.name` (now `builtin`) is `interceptor` while the block runs, as the interceptors above are while a
    scope is open: in when the first such block opens, out when the last one closes (nested and
    concurrent calls share one replacement), and a replacement someone else made meanwhile is left alone.
    The interceptor itself must send other threads' calls to `builtin`."""
    key = (id(module), name)
    with _LOCK:
        if _REPLACED.get(key, 0) == 0:
            setattr(module, name, interceptor)
        _REPLACED[key] = _REPLACED.get(key, 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            _REPLACED[key] -= 1
            if _REPLACED[key] == 0:
                del _REPLACED[key]
                if getattr(module, name) is interceptor:
                    setattr(module, name, builtin)


@contextmanager
def linears_on(route: LinearKernel, conv1d: bool = False) -> Iterator[None]:
    """This thread's (and context's) linear calls inside the block run on `route`; `conv1d`: the model
    has transformers `Conv1D` layers, whose addmm calls go there too."""
    conv1d_mode = Conv1dAddmmMode(route) if conv1d else contextlib.nullcontext()
    with _interceptors_in(), conv1d_mode, forward_with(linears=route):
        yield


def has_conv1d(model: torch.nn.Module) -> bool:
    """Whether `model` has transformers `Conv1D` layers (GPT-2's family)."""
    return any(type(module).__name__ == "Conv1D" for module in model.modules())


@contextmanager
def dropout_off() -> Iterator[None]:
    """This thread's dropout calls inside the block return their input, and SDPA runs without dropout."""
    with _interceptors_in(), forward_with(no_dropout=True):
        yield


@contextmanager
def compiled_dropout_off(off: bool) -> Iterator[None]:
    """Around a compiled graph's call: trace (or pick the graph traced) with dropout off where `off`.
    A process global, because dynamo reads no context variable; so that two threads' compiled steps
    never see each other's answer, the lock runs them one at a time (compiled steps of concurrent
    engine calls in one process are serialised)."""
    global _traced_dropout_off
    with _COMPILE_LOCK:
        before, _traced_dropout_off = _traced_dropout_off, off
        try:
            yield
        finally:
            _traced_dropout_off = before


def dropout_suppressed() -> bool:
    """Whether this thread's forwards run with dropout off (`dropout_off`)."""
    return active().no_dropout
