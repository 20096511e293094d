"""One decode step of a continuous-batching call.

`step.py` is the Llama-family step, written once over a `DecodeOps` record (`ops.py`: one callable per
op, filled by `decode_ops`, the one place that decides which ops run); `parts.py` holds the model's
parts it calls and `eligibility.py` says where it may stand in for the model's forward. `forms.py`
names the runner's forms: the model's forward, the engine's step, that step compiled or captured
(`captured.py`, over the persistent inputs of `graph_buffers.py`, recorded by `graph_capture.py`)."""
