"""Cost model for prefill buckets and generation routes (pure Python, never imports torch).

The model estimates only what *differs* between routes. Both routes run the same decode work for every
row, so the shared part is not modelled; what is modelled is

* a prefill forward of ``rows`` prompts padded to ``width`` tokens:
  ``fixed + token·rows·width + attention·GFLOPs(rows, width) + kv·MiB(rows, width)``, where the KV term
  (copying the prompt's keys/values into the continuous-batching cache) applies only to the bucketed route;
* the bucketed route's extra cost per decode step (``decode_ms``);
* two signed extensions for ordinary ``generate``: an extra per-step cost (``ordinary_decode_ms``) and a
  per-step term proportional to the cache size, because HF's DynamicCache re-concatenates the whole cache
  every step (``ordinary_decode_kv_ms``). With both at 0 the model is the reference's;
* a super-linear per-forward term ``forward_sq_ms·(thousand tokens)²`` (0 in the reference) where a CPU's
  caches make one large forward slower per token than several small ones; the planner respects it by
  capping a forward's tokens (`planning_token_limit`), so its DP stays linear in rows;
* the per-prompt cost of a packed prefill forward (``packed_prompt_ms``: its attention call per layer and
  its KV slice copy), read by the forms planner; no timed event of a call measures it, so online learning
  keeps the prior's value and only calibration fits it;
* the decode work both routes share (``step_ms + step_row_ms·rows + step_kv_ms·MiB attended``). It cancels
  in the route choice, so the reference leaves it out (all three 0); it is what lets a profile compare the
  model's prediction with a call's measured time, and what online learning fits from every decode step.

`timing_features` writes each measurable event of a call (a prefill forward, a KV copy, a decode step of
either route) as a linear function of the coefficients: the one place both the fits and the predictions
read the model from.

Costs are estimates, not device constants: calibrate them per model, device, dtype and attention backend.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from autobucket.checks import require_int

_MIB_BYTES = 2**20
_GIGA = 1e9


@dataclass(frozen=True, slots=True)
class CostCoefficients:
    """Millisecond coefficients of the route cost model; every value is a finite real >= 0."""

    fixed_ms: float = 25.0  # per prefill forward
    token_ms: float = 0.1  # per padded token position in a prefill forward
    attention_ms: float = 0.01  # per estimated attention GFLOP
    kv_ms: float = 0.04  # per MiB of KV written into the continuous-batching cache
    decode_ms: float = 10.0  # extra per continuous-batching decode step over ordinary generation
    ordinary_decode_ms: float = 0.0  # extra per ordinary decode step over the engine's decode step
    ordinary_decode_kv_ms: float = 0.0  # per MiB of KV cache per ordinary decode step (cache re-copy)
    step_ms: float = 0.0  # shared decode work per decode forward (both routes; cancels in route choice)
    step_row_ms: float = 0.0  # shared decode work per row per decode forward
    step_kv_ms: float = 0.0  # shared decode work per MiB of KV attended per decode forward
    forward_sq_ms: float = 0.0  # per (thousand padded tokens in one prefill forward)²; 0: the reference
    # per prompt in a packed prefill forward (planning/forms.py): calibration fits it from packed forwards;
    # files and caches without it load this default (within the range calibration finds on small models)
    packed_prompt_ms: float = 0.3

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            object.__setattr__(self, field.name, _checked_coefficient(field.name, value))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> CostCoefficients:
        """Build from a dict; the two ``ordinary_*`` extension keys may be absent (reference format)."""
        if not isinstance(data, dict):
            raise ValueError(f"cost coefficients must be a JSON object/dict, got {type(data).__name__}")
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown cost coefficient(s) {unknown}; expected a subset of {sorted(known)}"
                " (fix the key names or remove them)"
            )
        return cls(**data)


def _checked_coefficient(name: str, value: Any) -> float:
    # bool is an int subclass: True would silently mean a coefficient of one, never what a caller meant.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"cost coefficient {name}={value!r} is not a number; pass a finite float >= 0")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"cost coefficient {name}={value!r} is invalid; pass a finite float >= 0")
    return float(value)


def load_costs(path: str | Path) -> CostCoefficients:
    """Read coefficients from JSON: a plain dict of coefficients or ``{"costs": {...}, ...}``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read cost file {str(path)!r}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"cost file {str(path)!r} is not valid JSON: {exc}") from exc
    # The calibration format wraps the coefficients with schema_version/metadata next to them.
    if isinstance(data, dict) and "costs" in data:
        data = data["costs"]
    try:
        return CostCoefficients.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"cost file {str(path)!r}: {exc}") from exc


_DTYPE_BYTES = {
    "float64": 8, "double": 8, "fp64": 8,
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "half": 2, "fp16": 2,
}  # fmt: skip


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a torch/numpy dtype (anything with ``itemsize``) or a dtype name."""
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int) and not isinstance(itemsize, bool) and itemsize > 0:
        return itemsize
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        if name in _DTYPE_BYTES:
            return _DTYPE_BYTES[name]
    raise ValueError(f"unknown dtype {dtype!r}; pass a torch.dtype or one of {sorted(_DTYPE_BYTES)}")


def _config_value(config: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _required_config_value(config: Any, names: tuple[str, ...]) -> Any:
    value = _config_value(config, names)
    if value is None:
        raise ValueError(f"model config has none of {list(names)}; cannot read the model geometry")
    return value


_LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers")
_HEAD_NAMES = ("num_attention_heads", "n_head")
_HIDDEN_NAMES = ("hidden_size", "n_embd", "d_model")
_POSITION_NAMES = ("max_position_embeddings", "n_positions", "n_ctx")


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """The shape facts of a decoder that the cost model needs."""

    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int
    element_bytes: int  # bytes per KV element (4 for fp32, 2 for bf16/fp16)
    max_positions: int | None = None  # context limit; None when unknown

    def __post_init__(self) -> None:
        for name in ("layers", "query_heads", "kv_heads", "head_dim", "element_bytes"):
            _check_positive_int(name, getattr(self, name))
        if self.max_positions is not None:
            _check_positive_int("max_positions", self.max_positions)

    @classmethod
    def from_config(cls, hf_config: Any, dtype: Any) -> ModelGeometry:
        """Read an HF config (duck-typed; no transformers import) and a dtype for the KV elements."""
        text_config = getattr(hf_config, "text_config", None)
        # Multimodal configs keep the decoder's shape in text_config.
        if text_config is not None and _config_value(text_config, _LAYER_NAMES) is not None:
            hf_config = text_config
        heads = _required_config_value(hf_config, _HEAD_NAMES)
        head_dim = getattr(hf_config, "head_dim", None)
        if head_dim is None:
            head_dim = _required_config_value(hf_config, _HIDDEN_NAMES) // heads
        return cls(
            layers=_required_config_value(hf_config, _LAYER_NAMES),
            query_heads=heads,
            kv_heads=_kv_heads(hf_config, heads),
            head_dim=head_dim,
            element_bytes=dtype_bytes(dtype),
            max_positions=_config_value(hf_config, _POSITION_NAMES),
        )


def _kv_heads(hf_config: Any, query_heads: int) -> int:
    kv_heads = getattr(hf_config, "num_key_value_heads", None)
    return query_heads if kv_heads is None else kv_heads  # no GQA field: multi-head attention


def _check_positive_int(name: str, value: Any) -> None:
    require_int(f"model geometry {name}", value, 1, "read it from the model's config")


# The project's 20.3M-parameter benchmark Qwen2 (fp32); the `plan` CLI's default geometry.
BENCH_QWEN2_GEOMETRY = ModelGeometry(
    layers=4, query_heads=4, kv_heads=2, head_dim=64, element_bytes=4, max_positions=32768
)


def attention_gflops(rows: int, width: int, geometry: ModelGeometry) -> float:
    """Estimated attention GFLOPs of a prefill forward of ``rows`` prompts padded to ``width`` tokens."""
    per_token_pair = 4 * geometry.layers * geometry.query_heads * geometry.head_dim
    return per_token_pair * rows * width * width / _GIGA


def kv_mib(rows: int, width: float, geometry: ModelGeometry) -> float:
    """MiB of keys plus values that ``rows`` sequences of ``width`` tokens occupy in a KV cache."""
    per_token_bytes = 2 * geometry.layers * geometry.kv_heads * geometry.head_dim * geometry.element_bytes
    return per_token_bytes * rows * width / _MIB_BYTES


def prefill_cost_ms(
    rows: int,
    width: int,
    geometry: ModelGeometry,
    costs: CostCoefficients,
    include_kv_copy: bool = True,
) -> float:
    """Estimated ms of one prefill forward; the KV term is the copy into the continuous-batching cache."""
    total_ms = costs.fixed_ms + costs.token_ms * rows * width + costs.forward_sq_ms * (rows * width / 1e3) ** 2
    total_ms += costs.attention_ms * attention_gflops(rows, width, geometry)
    if include_kv_copy:
        total_ms += costs.kv_ms * kv_mib(rows, width, geometry)
    return total_ms


def split_forward_tokens(costs: CostCoefficients) -> int | None:
    """Padded tokens above which one prefill forward is estimated to cost more than two forwards of half
    the tokens (``forward_sq_ms·T²/2 > fixed_ms``); None when the super-linear term is 0."""
    if costs.forward_sq_ms <= 0:
        return None
    return int(1e3 * math.sqrt(2 * costs.fixed_ms / costs.forward_sq_ms))


def planning_token_limit(prefill_max_tokens: int | None, costs: CostCoefficients, longest: int) -> int | None:
    """The per-forward token limit the bucket DP plans with: the caller's, lowered to
    `split_forward_tokens` (never below the longest prompt, which cannot be split). The DP's per-row costs
    leave out the super-linear term; capping the forward size is how it respects it (`split_forward_tokens`)."""
    cap = split_forward_tokens(costs)
    if cap is None:
        return prefill_max_tokens
    cap = max(cap, longest)
    return cap if prefill_max_tokens is None else min(prefill_max_tokens, cap)


def prefill_row_terms_ms(geometry: ModelGeometry, costs: CostCoefficients) -> tuple[float, float]:
    """``(linear, quadratic)`` so that a bucketed prefill of B rows at width L costs
    ``fixed_ms + B·(linear·L + quadratic·L²)``: linear in B, hence the planner's fast DP."""
    linear_ms = costs.token_ms + costs.kv_ms * kv_mib(1, 1, geometry)
    quadratic_ms = costs.attention_ms * attention_gflops(1, 1, geometry)
    return linear_ms, quadratic_ms


def prefill_row_ms(width: int, geometry: ModelGeometry, costs: CostCoefficients) -> float:
    """Marginal ms of one more row in a bucketed prefill of ``width``; non-decreasing in width."""
    linear_ms, quadratic_ms = prefill_row_terms_ms(geometry, costs)
    return linear_ms * width + quadratic_ms * width * width


def ordinary_cost_ms(
    rows: int,
    width: int,
    max_new_tokens: int,
    geometry: ModelGeometry,
    costs: CostCoefficients,
) -> float:
    """Estimated ms of ordinary padded ``generate``: one prefill plus the ordinary decode extension."""
    steps = max(max_new_tokens - 1, 0)
    # Decode step t (1..steps) holds width + t positions, so sum_t (width + t) = steps*width + steps(steps+1)/2.
    cached_positions = steps * width + steps * (steps + 1) / 2
    decode_ms = costs.ordinary_decode_ms * steps
    decode_ms += costs.ordinary_decode_kv_ms * kv_mib(rows, cached_positions, geometry)
    return prefill_cost_ms(rows, width, geometry, costs, include_kv_copy=False) + decode_ms


def continuous_decode_cost_ms(max_new_tokens: int, costs: CostCoefficients) -> float:
    """Extra ms of the continuous-batching decode loop; the first token comes from prefill."""
    return costs.decode_ms * max(max_new_tokens - 1, 0)


# ------------------------------------------------------------------ measurable events of a call
PREFILL_FORWARD = "prefill"  # one prefill forward of `rows` prompts padded to `width` (no KV copy)
KV_COPY = "insert"  # copying `rows` prefilled prompts of `width` tokens into the continuous-batching cache
CB_STEP = "cb_step"  # one continuous-batching decode step of `rows` rows attending `width` columns
ORDINARY_STEP = "ordinary_step"  # one HF `generate` decode step of `rows` rows holding `width` positions
TIMING_KINDS = (PREFILL_FORWARD, KV_COPY, CB_STEP, ORDINARY_STEP)


def timing_features(kind: str, rows: int, width: float, geometry: ModelGeometry) -> dict[str, float]:
    """The event's cost as ``sum(coefficient · feature)``: coefficient name -> feature value."""
    if kind == PREFILL_FORWARD:
        return {"fixed_ms": 1.0, "token_ms": float(rows * width),
                "attention_ms": attention_gflops(rows, width, geometry),
                "forward_sq_ms": (rows * width / 1e3) ** 2}
    if kind == KV_COPY:
        return {"kv_ms": kv_mib(rows, width, geometry)}
    attended_mib = kv_mib(rows, width, geometry)
    shared = {"step_ms": 1.0, "step_row_ms": float(rows), "step_kv_ms": attended_mib}
    if kind == CB_STEP:
        return {**shared, "decode_ms": 1.0}
    if kind == ORDINARY_STEP:
        return {**shared, "ordinary_decode_ms": 1.0, "ordinary_decode_kv_ms": attended_mib}
    raise ValueError(f"timing kind {kind!r} is unknown; expected one of {TIMING_KINDS}")


def timing_ms(kind: str, rows: int, width: float, geometry: ModelGeometry, costs: CostCoefficients) -> float:
    """Predicted ms of one measurable event (see `timing_features`)."""
    features = timing_features(kind, rows, width, geometry)
    return sum(getattr(costs, name) * value for name, value in features.items())
