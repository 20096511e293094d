"""autobucket: fast, token-exact batched generation for Hugging Face causal LMs.

The planner (`autobucket.costs`, `autobucket.planner`) is pure Python and never imports torch, so
this package resolves its torch-backed names lazily: `import autobucket.planner` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY_NAMES = {
    "CostCoefficients": "autobucket.costs",
    "ModelGeometry": "autobucket.costs",
    "plan_prefill": "autobucket.planner",
    "choose_route": "autobucket.route_choice",
    "PrefillPlan": "autobucket.planner",
    "RouteDecision": "autobucket.route_choice",
    "Rollout": "autobucket.rollout",
    "RolloutResult": "autobucket.result",
    "RolloutConfig": "autobucket.config",
    "SamplingConfig": "autobucket.config",
    "Profile": "autobucket.profile",
    "load_model": "autobucket.models",
}

__all__ = ["__version__", *_LAZY_NAMES]


def __getattr__(name: str) -> Any:
    module_name = _LAZY_NAMES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'autobucket' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
