"""The forms of a continuous-batching call's decode step, chosen once when its runner is built.

MODEL: the model's forward (any model; every other model than the Llama family's exact classes).
ENGINE: the engine's Llama-family step (`step.py`), eager, bitwise the model's forward on the same kernels.
COMPILED: that same step under torch.compile over static shapes (a model the step cannot stand in for
compiles its forward instead); a step it cannot take runs eagerly.
CAPTURED: the engine's step recorded in a CUDA graph per (row bucket, column bucket) and replayed
(`captured.py`; CUDA only, or its CPU stand-in under a test switch); a step past the graph limit runs eagerly."""

from __future__ import annotations

MODEL, ENGINE, COMPILED, CAPTURED = "model", "engine", "compiled", "captured"


def decode_form(has_engine_step: bool, compiled: bool, captured: bool = False) -> str:
    """The form a runner decodes in: COMPILED with a compiled step, CAPTURED with captured steps, else
    ENGINE where the engine's step may stand in for the model's forward, else MODEL."""
    if compiled:
        return COMPILED
    if captured:
        return CAPTURED
    return ENGINE if has_engine_step else MODEL
