"""The op families a forward plan names, and the forms of the decode step.

A plan assigns each family to one backend (`backends.py`): the model's own torch code ("torch"), the
engine's C++ kernels ("cpu") or its Triton kernels ("triton"), or a backend a user registered."""

from __future__ import annotations

LINEAR = "linear"  # every F.linear (and transformers' Conv1D addmm) of the forward
PREFILL_ATTENTION = "prefill_attention"  # attention over a prompt (padded, packed, chunked)
DECODE_ATTENTION = "decode_attention"  # one new query per row over the static cache
SHARED_PREFIX_ATTENTION = "shared_prefix_attention"  # decode attention over K/V that several rows read
RMS_NORM = "rms_norm"  # the Llama family's RMSNorm forward
ROTARY = "rotary"  # the Llama family's apply_rotary_pos_emb
GATED_MLP = "gated_mlp"  # the Llama family's MLP forward (SiLU-and-multiply)
SELECTION = "selection"  # sampling / argmax over the step's logits
LOGPROBS = "logprobs"  # log-softmax reductions of the sampled tokens

OPS = (
    LINEAR, PREFILL_ATTENTION, DECODE_ATTENTION, SHARED_PREFIX_ATTENTION, RMS_NORM, ROTARY, GATED_MLP,
    SELECTION, LOGPROBS,
)  # fmt: skip
# the modeling code's ops a backend replaces through `intercept/elementwise.py`
ELEMENTWISE_OPS = (ROTARY, GATED_MLP, RMS_NORM)
# one kernel set runs these together: its linears and its attention are what makes a forward invariant
KERNEL_SET_OPS = (LINEAR, PREFILL_ATTENTION)

# The decode step's forms: the model's forward, the engine's Llama-family step (eager), that step
# compiled, that step captured in a CUDA graph.
DECODE_STEPS = ("model", "engine", "compiled", "captured")
