"""The `Backend` interface and its registry.

A backend names, for each op family (`ops.py`), either the function it runs for `model` or the reason it
cannot run it there (a string). What a function is depends on the op: for the elementwise families it
replaces the modeling code's call (same arguments; NotImplemented where it cannot take one call); for the
others it is what the engine's step calls (see each built-in backend). `None` means the model's own code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Supplied = Callable | str | None  # the function, the reason it cannot, or None: the model's own code


class Backend:
    """A named set of ops. Subclasses override `supply`; the default supplies nothing."""

    name: str = ""

    def supply(self, op: str, model: torch.nn.Module) -> Supplied:
        """The function this backend runs for `op` on `model`, or the reason it cannot (a string)."""
        return f"the {self.name!r} backend has no {op}"


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Make `backend` choosable by name (`RolloutConfig(op_backends={op: name})`); a later backend of the
    same name replaces the earlier one. Returns it."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend takes a Backend, got {type(backend).__name__}: subclass autobucket's Backend")
    if not isinstance(backend.name, str) or not backend.name:
        raise ValueError(f"a backend needs a name (a non-empty string), got {backend.name!r}: set the class's name")
    _BACKENDS[backend.name] = backend
    return backend


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def registered_backend(name: str) -> Backend:
    """The backend registered as `name`; ValueError naming the registered ones otherwise."""
    backend = _BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"no backend is registered as {name!r}: choose one of {', '.join(_BACKENDS)} (or register_backend yours)")
    return backend
