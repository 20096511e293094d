"""How the engine runs the trainer's own model without changing it: unwrapping what trainers hand over
and what differs between transformers versions (`hf_compat`), the direct decode step, sharded and
versioned weights. What a forward runs is decided by the forward plan and reached through
`engine/intercept/`."""

from autobucket.engine.model_access.hf_compat import ForwardSpec, forward_spec, unwrap_model

__all__ = ["ForwardSpec", "forward_spec", "unwrap_model"]
