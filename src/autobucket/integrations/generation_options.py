"""What both trainer adapters read from a transformers GenerationConfig before they sample with autobucket.

The warpers autobucket implements (min_p, typical_p, epsilon_cutoff, eta_cutoff; temperature, top_k and
top_p are read by each adapter) are translated into `SamplingConfig` fields exactly when transformers
would apply them (`GenerationMixin._get_logits_processor`); the ones it does not implement are refused."""

from __future__ import annotations

from typing import Any

# GenerationConfig sampling options autobucket does not implement -> the value that means "off".
UNSUPPORTED_WARPERS = {"top_h": None}


def reject_unsupported_warpers(generation_config: Any, where: str, fix: str) -> None:
    """ValueError naming the first active option autobucket cannot apply; `where` says whose config it is
    ("generation option", "the model's generation_config sets"), `fix` how to turn it off ({option} and
    {off} are filled in)."""
    for option, off in UNSUPPORTED_WARPERS.items():
        value = getattr(generation_config, option, None)
        if value is not None and value != off:
            raise ValueError(
                f"{where} {option}={value!r}, which autobucket cannot apply when sampling: "
                + fix.format(option=option, off=off)
            )


def warper_settings(generation_config: Any) -> dict[str, float]:
    """SamplingConfig's min_p / typical_p / epsilon_cutoff / eta_cutoff for what transformers applies when
    it samples with `generation_config`: min_p whenever set, typical_p below 1, the cutoffs strictly inside
    (0, 1); anything else is off there, so off here. A value transformers would refuse (min_p 1.5, a
    negative typical_p) reaches SamplingConfig, whose ValueError names it."""
    settings: dict[str, float] = {}
    min_p = getattr(generation_config, "min_p", None)
    if min_p is not None:
        settings["min_p"] = float(min_p)
    typical_p = getattr(generation_config, "typical_p", None)
    if typical_p is not None and typical_p < 1.0:
        settings["typical_p"] = float(typical_p)
    for cutoff in ("epsilon_cutoff", "eta_cutoff"):
        value = getattr(generation_config, cutoff, None)
        if value is not None and 0.0 < value < 1.0:
            settings[cutoff] = float(value)
    return settings
