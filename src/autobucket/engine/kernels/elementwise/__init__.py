"""The model's own elementwise code on fused kernels (Llama family): the rotary embedding, the MLP's
SiLU-and-multiply and RMSNorm, each bitwise the eager code's values, reached by interceptors on the
modeling module while a call is in flight (`engine/intercept/elementwise.py`)."""
