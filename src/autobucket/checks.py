"""Argument checks shared by every layer (standard library only, so the pure planner can use them).

One definition of "an int": Python and numpy integers count, `bool` never does. Each check raises a
`ValueError` that names the field, the value and the fix, and returns the value as a plain Python type.
`warn_once` is the one way a check that runs on every call (every Rollout) warns once per process."""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Any


@functools.cache
def warn_once(message: str, category: type[Warning], stacklevel: int) -> None:
    """`warnings.warn(message, category, stacklevel)` (counted from this function's frame), once per process
    for each message: not left to the warnings registry, which importing transformers resets."""
    warnings.warn(message, category, stacklevel=stacklevel)


def require_int(field: str, value: Any, minimum: int = 1, fix: str = "") -> int:
    """`value` as an int >= `minimum`, else a ValueError naming `field` (and `fix`, when given)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        hint = f"; {fix}" if fix else ""
        raise ValueError(f"{field}={value!r} is invalid: expected an int >= {minimum}{hint}")
    return int(value)


def plain_int_or_list(value: Any) -> int | list[int] | None:
    """`value` as a plain int or a list of plain ints (Python or numpy integers; a list, a tuple, or a 1-D
    array or tensor of them), or None when it is not one of those. Range checks are the caller's."""
    if _is_int(value):
        return int(value)
    if getattr(value, "ndim", None) == 1 and hasattr(value, "tolist"):  # numpy array, torch tensor
        value = value.tolist()
    if isinstance(value, (list, tuple)) and all(_is_int(item) for item in value):
        return [int(item) for item in value]
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def optional_int(field: str, value: Any, minimum: int = 1, fix: str = "") -> int | None:
    """`require_int`, with None passed through (None usually means "no limit")."""
    return None if value is None else require_int(field, value, minimum, fix)


def require_finite(field: str, value: Any, fix: str = "", minimum: float | None = None) -> float:
    """`value` as a finite float (>= `minimum` when given), else a ValueError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{field}={value!r} is invalid: expected a finite number" + (f"; {fix}" if fix else ""))
    if minimum is not None and value < minimum:
        raise ValueError(f"{field}={value!r} is invalid: expected a number >= {minimum}" + (f"; {fix}" if fix else ""))
    return float(value)


def require_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{field}={value!r} is invalid: expected True or False")
    return value


def require_choice(field: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """`value` if it is one of `choices` (same type too: 1 is not True), else a ValueError listing them."""
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        raise ValueError(f"{field}={value!r} is invalid: expected one of {', '.join(map(repr, choices))}")
    return value
