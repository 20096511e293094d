"""Continuous batching on a static KV cache: the host loop (`batcher`), the device work it drives
(`model_runner`, with one `DecodeRows` record per row), the cache (`static_cache`) and the three prefill
forms (`prefill` padded, `packed_prefill`, `chunked_prefill`)."""

from autobucket.engine.batching.batcher import ContinuousBatcher
from autobucket.engine.batching.model_runner import CacheShape, ModelRunner
from autobucket.engine.batching.static_cache import StaticKVCache

__all__ = ["CacheShape", "ContinuousBatcher", "ModelRunner", "StaticKVCache"]
