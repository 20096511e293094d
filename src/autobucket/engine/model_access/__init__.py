"""How the engine runs the trainer's own model without changing it: unwrapping what trainers hand over
and what differs between transformers versions (`hf_compat`), the engine's attention chosen per forward
by a thread-safe dispatcher and eval semantics without flipping `training` (`attention`), and the
autograd mode a model's own hooks allow (`grad_mode`)."""

from autobucket.engine.model_access.hf_compat import ForwardSpec, forward_spec, unwrap_model

__all__ = ["ForwardSpec", "forward_spec", "unwrap_model"]
