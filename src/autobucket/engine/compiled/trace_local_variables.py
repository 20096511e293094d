"""The kernels hub's and transformers' per-forward variables, made safe for other threads' forwards while
this process compiles.

Both libraries keep per-forward state in a `CompileableContextVar`: the kernels hub's model-private
kernel functions (set by every `use_kernelized_func` attention forward of transformers 5.x) and
transformers' output collector (set by every `capture_outputs` model forward). It is a `ContextVar` for
eager code and a process global "while compiling", because dynamo cannot trace a `ContextVar`. But they
ask `torch.compiler.is_compiling()`, which torch holds True for every thread through a whole compile
session, so a trainer thread's eager forward during the engine's compile writes the global; and the
compiled graph replays, after each of its calls, the attribute stores its trace made (the hub's
`uses_global_var = True` when the trace read such a write). The other thread's `reset` of a
`ContextVar` token then finds the global switched on and stores the token as the value, and every later
forward of the process fails with "'_contextvars.Token' object is not iterable" (kernels 0.19, torch
2.13). Transformers' collector instead loses or mixes up the other thread's captured hidden states.

`TraceLocalVariable` takes each one's place, keeping its `ContextVar` (a token taken before the swap
resets as before): running code reads and writes only the context variable, whatever any thread is
compiling; code dynamo traces (`torch.compiler.is_dynamo_compiling()`, True only under dynamo's trace)
uses a value that no running code reads, so what a graph replays reaches no forward."""

from __future__ import annotations

import contextvars
import sys
import threading
from typing import Any

import torch

# (module, attribute) of each library variable of the racing kind; modules not imported yet are skipped
# (no forward uses them), and a later call swaps them once they are.
LIBRARY_VARIABLES = (
    ("kernels._internals.layer.layer", "_ACTIVE_KERNEL_FUNCS"),
    ("transformers.utils.output_capturing", "_active_collector"),
)
_LOCK = threading.Lock()


class TraceLocalVariable:
    """A `CompileableContextVar`'s interface (get, set, reset) that is a `ContextVar` for running code on
    every thread, and a value of dynamo's trace alone for traced code."""

    def __init__(self, replaced: Any) -> None:
        self.context_var: contextvars.ContextVar = replaced.context_var
        self.replaced = replaced  # resets what its global mode handed out before the swap
        self.traced_value: Any = None  # written only under dynamo's trace (and by the graph's replay)

    def get(self) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return self.traced_value
        return self.context_var.get()

    def set(self, value: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            previous, self.traced_value = self.traced_value, value
            return previous
        return self.context_var.set(value)

    def reset(self, token: Any) -> None:
        if torch.compiler.is_dynamo_compiling():
            self.traced_value = token
        elif isinstance(token, contextvars.Token):
            self.context_var.reset(token)
        else:  # the replaced variable's own global-mode token, from a `set` made before the swap
            self.replaced.reset(token)


def is_racing_kind(value: Any) -> bool:
    """A library `CompileableContextVar` (not yet replaced): the kind that goes global while compiling."""
    return type(value).__name__ == "CompileableContextVar" and isinstance(
        getattr(value, "context_var", None), contextvars.ContextVar
    )


def make_trace_local() -> None:
    """Put a `TraceLocalVariable` in the place of each imported library variable of the racing kind (a
    no-op once done). The libraries' forwards look the variable up as a module global at each use."""
    with _LOCK:
        for module_name, attribute in LIBRARY_VARIABLES:
            module = sys.modules.get(module_name)
            current = getattr(module, attribute, None)
            if is_racing_kind(current):
                setattr(module, attribute, TraceLocalVariable(current))
