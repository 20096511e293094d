"""autobucket: fast, token-exact batched generation for Hugging Face causal LMs.

The planner (`autobucket.planning.costs`, `autobucket.planning.planner`) is pure Python and never imports torch, so
this package resolves its torch-backed names lazily: `import autobucket.planning.planner` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY_NAMES = {
    "CostCoefficients": "autobucket.planning.costs",
    "ModelGeometry": "autobucket.planning.costs",
    "plan_prefill": "autobucket.planning.planner",
    "choose_route": "autobucket.planning.route_choice",
    "PrefillPlan": "autobucket.planning.planner",
    "RouteDecision": "autobucket.planning.route_choice",
    "Rollout": "autobucket.engine.rollout",
    "RolloutResult": "autobucket.result",
    "RolloutConfig": "autobucket.config",
    "SamplingConfig": "autobucket.config",
    "Profile": "autobucket.profile",
    "load_model": "autobucket.models",
    "RayRollout": "autobucket.distributed",
}

__all__ = ["__version__", *_LAZY_NAMES]


def __getattr__(name: str) -> Any:
    module_name = _LAZY_NAMES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'autobucket' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
