"""The kernels the engine owns instead of running the model's forward op by op (`kernels="invariant"`):
linear layers on prepacked, batch-invariant weights that follow the live weights."""

from autobucket.engine.kernels.onednn_probes import onednn_available
from autobucket.engine.kernels.packed_linear import PackedLinears, packed_linears

__all__ = ["PackedLinears", "onednn_available", "packed_linears"]
