"""What `calibrate` measures: the shapes (`Shape`), the plan (`CalibrationPlan`), and the default and quick
grids sized from the model's context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from autobucket.planning.forms import FormCosts

DEFAULT_MAX_LENGTH = 512
DEFAULT_MAX_SHAPE_TOKENS = 16384  # largest B·L of the default grid (32 × 512)
DEFAULT_MAX_SECONDS = 60.0  # measuring stops here, finished or not
MAX_SPREAD = 0.25  # a shape whose samples spread more than this (scaled MAD / median) is noisy
MAX_HOLDOUT_ERROR = 0.2  # a fit whose held-out median error exceeds this is refused


@dataclass(frozen=True)
class Shape:
    rows: int  # B
    width: int  # L, tokens per prompt (uniform)

    def __str__(self) -> str:
        return f"{self.rows}:{self.width}"


@dataclass(frozen=True)
class CalibrationPlan:
    """What `calibrate` measures."""

    prefill_shapes: tuple[Shape, ...]
    holdout_shapes: tuple[Shape, ...] = ()
    decode_shapes: tuple[Shape, ...] = ()
    decode_new_tokens: int = 16
    repeats: int = 5
    warmup: int = 1
    seed: int = 0
    max_seconds: float = DEFAULT_MAX_SECONDS
    packed_shapes: tuple[Shape, ...] = ()  # B prompts of L tokens packed in one row (fits packed_prompt_ms)

    def __post_init__(self) -> None:
        if not (isinstance(self.max_seconds, (int, float)) and self.max_seconds > 0):
            raise ValueError(f"max_seconds={self.max_seconds!r} is invalid: expected seconds > 0")
        for name in ("repeats", "warmup", "decode_new_tokens"):
            value = getattr(self, name)
            minimum = {"repeats": 1, "warmup": 0, "decode_new_tokens": 2}[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}={value!r} is invalid: expected an int >= {minimum}")
        if not self.prefill_shapes:
            raise ValueError("prefill_shapes is empty: give at least one B:L shape to measure")

    @property
    def items(self) -> int:
        return len(self.prefill_shapes) + len(self.holdout_shapes) + len(self.decode_shapes) + len(self.packed_shapes)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("prefill_shapes", "holdout_shapes", "decode_shapes", "packed_shapes"):
            data[name] = [str(shape) for shape in getattr(self, name)]
        return data


def default_plan(
    max_positions: int | None,
    max_length: int | None = None,
    repeats: int = 5,
    decode_new_tokens: int = 16,
    max_shape_tokens: int = DEFAULT_MAX_SHAPE_TOKENS,
) -> CalibrationPlan:
    """Short, typical and long prompts up to ``max_length`` (default: min(512, context)), B from 1 to 32.

    Held-out shapes sit between the fitted ones (other batch sizes, widths at 3/4 of a fitted width).
    """
    longest = _default_max_length(max_positions, max_length, decode_new_tokens)

    def grid(fractions: Sequence[float], batches: Sequence[int]) -> tuple[Shape, ...]:
        widths = sorted({max(1, round(longest * f)) for f in fractions})
        return tuple(Shape(b, w) for b in batches for w in widths if b * w <= max_shape_tokens)

    fitted = grid((1 / 128, 1 / 32, 1 / 8, 1 / 4, 1 / 2, 1), (1, 4, 16, 32))
    holdout = grid((3 / 64, 3 / 16, 3 / 8, 3 / 4), (2, 8, 24))
    decode = tuple(
        Shape(b, max(1, round(longest * f)))
        for b, f in ((32, 1 / 32), (8, 1 / 4), (32, 1 / 4), (8, 1), (32, 1))
    )
    return CalibrationPlan(fitted, holdout, tuple(dict.fromkeys(decode)), decode_new_tokens, repeats,
                           packed_shapes=packed_shapes_for(fitted))


def packed_shapes_for(shapes: Sequence[Shape]) -> tuple[Shape, ...]:
    """The shapes of `shapes` worth packing: at least 2 prompts, within the planner's packed-row bound."""
    limit = FormCosts().packed_max_tokens or DEFAULT_MAX_SHAPE_TOKENS
    return tuple(shape for shape in shapes if shape.rows >= 2 and shape.rows * shape.width <= limit)


def quick_plan(max_positions: int | None, repeats: int = 3, max_seconds: float = DEFAULT_MAX_SECONDS) -> CalibrationPlan:
    """A small grid: every coefficient, two held-out shapes, at most 512 tokens per forward and short
    decode calls (~2,500 prompt tokens a round), so a small model gets several rounds in within a
    minute even on one busy CPU core."""
    longest = min(128, _default_max_length(max_positions, None, 8))
    widths = sorted({max(1, round(longest * f)) for f in (1 / 16, 1 / 4, 1)})
    prefill = tuple(Shape(b, w) for b in (1, 4, 16) for w in widths if b * w <= 512)
    holdout = tuple(Shape(b, max(1, longest // d)) for b, d in ((2, 2), (8, 8), (1, 2), (4, 8)))
    decode = (Shape(4, widths[0]), Shape(8, widths[1]))
    return CalibrationPlan(prefill, holdout, decode, 6, repeats, warmup=0, max_seconds=max_seconds,
                           packed_shapes=packed_shapes_for(prefill))


def _default_max_length(max_positions: int | None, max_length: int | None, new_tokens: int) -> int:
    if max_length is not None:
        if max_positions is not None and max_length + new_tokens > max_positions:
            raise ValueError(
                f"max_length={max_length} + {new_tokens} new tokens exceeds the model's context of "
                f"{max_positions} positions: lower --max-length"
            )
        return max_length
    if max_positions is None:
        return DEFAULT_MAX_LENGTH
    return max(1, min(DEFAULT_MAX_LENGTH, max_positions - new_tokens))
