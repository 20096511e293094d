"""What both trainer adapters check in a transformers GenerationConfig before they sample with autobucket."""

from __future__ import annotations

from typing import Any

# GenerationConfig sampling options autobucket does not implement -> the value that means "off".
UNSUPPORTED_WARPERS = {"min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}


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
