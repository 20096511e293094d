"""Asynchronous rollouts on the trainer's model: `AsyncEngine` (requests joining a running continuous
batch, streamed, aborted, continued across weight updates) and its OpenAI-compatible HTTP server."""

from autobucket.serving.engine import AsyncEngine
from autobucket.serving.handle import RequestHandle
from autobucket.serving.request import RequestOutput, StreamChunk

__all__ = ["AsyncEngine", "RequestHandle", "RequestOutput", "StreamChunk"]
