"""autobucket: fast, token-exact batched generation for Hugging Face causal LMs.

The planner (`autobucket.costs.coefficients`, `autobucket.planning.planner`) is pure Python and never imports torch, so
this package resolves its torch-backed names lazily: `import autobucket.planning.planner` stays light. A type
checker reads the same names from the `TYPE_CHECKING` block below (tests/project/test_defaults.py keeps the two in step).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autobucket.config import CompileChoice, RolloutConfig, Route, SamplingConfig
    from autobucket.costs.coefficients import CostCoefficients, ModelGeometry
    from autobucket.distributed import RayRollout
    from autobucket.engine.intercept.trainer import invariant
    from autobucket.engine.rollout import Rollout
    from autobucket.engine.trainer_logprobs import trainer_logprobs
    from autobucket.models import load_model
    from autobucket.planning.planner import PrefillPlan, plan_prefill
    from autobucket.planning.route_choice import RouteDecision, choose_route
    from autobucket.profile import Profile
    from autobucket.result import RolloutResult

__version__ = "0.1.0"

_LAZY_NAMES = {
    "CostCoefficients": "autobucket.costs.coefficients",
    "ModelGeometry": "autobucket.costs.coefficients",
    "plan_prefill": "autobucket.planning.planner",
    "choose_route": "autobucket.planning.route_choice",
    "PrefillPlan": "autobucket.planning.planner",
    "RouteDecision": "autobucket.planning.route_choice",
    "Rollout": "autobucket.engine.rollout",
    "RolloutResult": "autobucket.result",
    "RolloutConfig": "autobucket.config",
    "SamplingConfig": "autobucket.config",
    "Route": "autobucket.config",
    "CompileChoice": "autobucket.config",
    "Profile": "autobucket.profile",
    "load_model": "autobucket.models",
    "RayRollout": "autobucket.distributed",
    "invariant": "autobucket.engine.intercept.trainer",
    "trainer_logprobs": "autobucket.engine.trainer_logprobs",
}

# A literal list, so that type checkers see what is exported (the same names as `_LAZY_NAMES`).
__all__ = [
    "__version__",
    "CostCoefficients",
    "ModelGeometry",
    "plan_prefill",
    "choose_route",
    "PrefillPlan",
    "RouteDecision",
    "Rollout",
    "RolloutResult",
    "RolloutConfig",
    "SamplingConfig",
    "Route",
    "CompileChoice",
    "Profile",
    "load_model",
    "RayRollout",
    "invariant",
    "trainer_logprobs",
]

if not TYPE_CHECKING:  # hidden from checkers: a misspelt name must be an error there, not `Any`

    def __getattr__(name: str) -> Any:
        module_name = _LAZY_NAMES.get(name)
        if module_name is None:
            raise AttributeError(f"module 'autobucket' has no attribute {name!r}")
        return getattr(importlib.import_module(module_name), name)
