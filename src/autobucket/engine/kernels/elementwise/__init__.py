"""The model's own elementwise code on fused kernels (Llama family; any kernel set): the rotary
embedding, the MLP's SiLU-and-multiply and RMSNorm, each bitwise the eager code's values, reached by
routers on the modeling module while a call is in flight (`routes.py`)."""

from autobucket.engine.kernels.elementwise.scope import fused_elementwise

__all__ = ["fused_elementwise"]
