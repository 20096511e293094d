"""The torch engine: `Rollout`, the routes and their registry, the continuous-batching loop (host
bookkeeping in `batcher`, device work in `model_runner`), the static KV cache, prefill, the ordinary
route, token selection, generation setup and transformers compatibility."""

from autobucket.engine.rollout import Rollout
from autobucket.engine.routes import ROUTES, RouteCall

__all__ = ["ROUTES", "Rollout", "RouteCall"]
