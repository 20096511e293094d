"""Adapters that make autobucket the generation backend of RL trainers (imported on demand).

Each adapter imports its trainer library, so import the one you need explicitly:
`autobucket.integrations.trl` (TRL's GRPO trainer) or `autobucket.integrations.deepspeed` (DeepSpeed's
rollout interface). This package itself imports nothing heavy."""

__all__: list[str] = []
