"""Adapters that make autobucket the generation backend of RL trainers (imported on demand)."""

__all__: list[str] = []
