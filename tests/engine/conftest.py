"""Fixtures for the engine's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def always_share(monkeypatch):
    """Every multi-sample prompt and shared prefix decodes over one copy of its K/V (cascade decode; by
    default it starts only when the copies saved are large, `SHARED_PREFIX_MIN_SAVED_COLUMNS`)."""
    from autobucket.engine import routes
    from autobucket.engine.batching import model_runner

    monkeypatch.setattr(routes, "SHARED_PREFIX_MIN_SAVED_COLUMNS", 0)
    monkeypatch.setattr(model_runner, "SHARED_PREFIX_MIN_SAVED_COLUMNS", 0)

