"""The compiled decode step (`torch.compile` over static shapes), the call's compile decision and what
differs between torch versions' dynamo (limit names, how a model's own error shows while traced)."""

from autobucket.engine.compiled.compiled_decode import CompiledDecode, StepInputs

__all__ = ["CompiledDecode", "StepInputs"]
