"""Pure planning (standard library only, never torch): the exact prefill-bucket DP, the route choice and
data-parallel sharding, over the cost model's pure part (`autobucket.costs.coefficients`)."""

from autobucket.costs.coefficients import CostCoefficients, ModelGeometry
from autobucket.planning.planner import PrefillPlan, plan_prefill
from autobucket.planning.route_choice import RouteDecision, choose_route
from autobucket.planning.sharding import ShardPlan, plan_shards

__all__ = [
    "CostCoefficients",
    "ModelGeometry",
    "PrefillPlan",
    "RouteDecision",
    "ShardPlan",
    "choose_route",
    "plan_prefill",
    "plan_shards",
]
