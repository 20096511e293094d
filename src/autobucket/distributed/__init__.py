"""Data-parallel generation on Ray: `RayRollout` and its merged `DistributedResult`."""

from autobucket.distributed.ray_rollout import RayRollout
from autobucket.distributed.result import DistributedResult

__all__ = ["DistributedResult", "RayRollout"]
