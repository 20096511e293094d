"""The scope of one engine call in which the model's own elementwise code takes the fused kernels."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from autobucket.engine.kernels.elementwise import gated_mlp, rms_norm, rotary
from autobucket.engine.kernels.elementwise.routes import (
    FUSED_FORWARDS,
    family_class,
    llama_modeling_module,
    routed,
)
from autobucket.engine.kernels.library import kernel_library_builds
from autobucket.engine.kernels.scope import runs_triton_set
from autobucket.engine.model_access.function_routes import context_value


@contextmanager
def fused_elementwise(model: torch.nn.Module) -> Iterator[None]:
    """This thread's forwards of a Llama-family `model` inside the block run the rotary embedding, the
    MLP's SiLU-and-multiply and the RMSNorms on the fused kernels where they can (bitwise the same values;
    see `routes.py`); other models, and every other thread, run as they are. Nothing of the model changes."""
    modeling = llama_modeling_module(model)
    if modeling is None or not kernel_library_builds():
        yield
        return
    with ExitStack() as stack:
        stack.enter_context(routed(modeling, rotary.NAME, modeling, rotary.router_for))
        mlp_class = family_class(model, modeling, "MLP")
        if mlp_class is not None and gated_mlp.available():
            stack.enter_context(routed(mlp_class, "forward", modeling, gated_mlp.router_for))
        norm_class = family_class(model, modeling, "RMSNorm")
        # the Triton set routes the RMSNorms to its own kernel (`triton/norm_route.py`)
        triton_norms = runs_triton_set(next(model.parameters()).device)
        if norm_class is not None and rms_norm.available() and not triton_norms:
            stack.enter_context(routed(norm_class, "forward", modeling, rms_norm.router_for))
        stack.enter_context(context_value(FUSED_FORWARDS, True))
        yield
