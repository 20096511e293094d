"""What the compiled decode step needs to know about dynamo across torch versions: the name of its
graph limit, and how to tell the model's own exception from a failure to compile.

Measured on torch 2.13: an exception the traced code raises (`raise ValueError(...)` in a model's
forward) does not reach the caller under `fullgraph=True`. Dynamo raises `Unsupported("Observed
exception")` whose `__cause__` is a stand-in class, `Observed<Name>Error` (an `ObservedException`),
created per user exception type; the real exception object never exists, because its code never ran.
An exception raised by a compiled graph at *run time* (an allocation failure, a custom op) propagates
as itself. Dynamo's own consistency checks raise plain `AssertionError`s from its own code (not a
`TorchDynamoException`): "Guard failed on the same frame it was created", met when another thread
writes process-wide state the trace read before dynamo checks the guards it built on it (the kernels
hub's variable was such state for other threads' forwards until `trace_local_variables` took its place)."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

LIFTED_GRAPH_LIMIT = 1 << 20


def dynamo_limit_name(config: Any) -> str | None:
    """The name of dynamo's per-function graph limit in this torch: `recompile_limit` (2.7+), formerly
    `cache_size_limit`; None when neither exists (dynamo's own limit then applies)."""
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            return name
    return None


def lifted_graph_limit(config: Any = None) -> AbstractContextManager:
    """Dynamo's per-function graph limit out of the way for one call of the compiled step (`config`:
    torch._dynamo.config unless given)."""
    # One compiled function serves every model and shape, so dynamo's default (8) would refuse graphs
    # we want; the compiled step's own caps (graphs and recompiles per model) apply instead.
    config = torch._dynamo.config if config is None else config
    name = dynamo_limit_name(config)
    return config.patch(**{name: LIFTED_GRAPH_LIMIT}) if name is not None else nullcontext()


def observed_model_error(error: BaseException) -> BaseException | None:
    """Dynamo's stand-in for an exception the traced code raised (found along the cause chain), or None."""
    observed = getattr(torch._dynamo.exc, "ObservedException", ())
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if isinstance(link, observed):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def observed_description(observed: BaseException) -> str:
    """The stand-in's first line and the traced source line that raised. The source line carries the
    model's message on every torch: 2.13's stand-in repeats the exception's arguments, 2.11's names only
    its type (`raised exception UserDefinedExceptionObjectVariable(ModelError)`)."""
    text = str(observed).strip()
    description = text.splitlines()[0][:200] if text else type(observed).__name__
    stack = getattr(observed, "real_stack", None)
    if stack and stack[-1].line:
        frame = stack[-1]
        description += f" at {os.path.basename(frame.filename)}:{frame.lineno}: {frame.line.strip()[:200]}"
    return description


def is_observed_not_implemented(observed: BaseException) -> bool:
    """The traced code raised NotImplementedError: code saying it cannot be compiled, not a model error."""
    return isinstance(observed, getattr(torch._dynamo.exc, "ObservedNotImplementedError", ()))


_COMPILER_PACKAGES = tuple(
    os.path.join(os.path.dirname(torch.__file__), package) + os.sep for package in ("_dynamo", "_inductor")
)


def raised_by_compiler(error: BaseException) -> bool:
    """An AssertionError raised in dynamo's or inductor's own code (its innermost frame is there): a failure
    to compile, never the model's (a model's assert raised while traced reaches us as dynamo's
    `ObservedException` stand-in; one raised by a compiled graph at run time has the model's frame last)."""
    if not isinstance(error, AssertionError) or error.__traceback__ is None:
        return False
    innermost = error.__traceback__
    while innermost.tb_next is not None:
        innermost = innermost.tb_next
    return os.path.abspath(innermost.tb_frame.f_code.co_filename).startswith(_COMPILER_PACKAGES)
