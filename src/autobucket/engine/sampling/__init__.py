"""The parts of token selection (`engine/selection.py` puts them together for every route): random streams
keyed by a request's identity, HF's warpers, the inverse-CDF sampler and the first argmax."""

from autobucket.engine.sampling.argmax import first_argmax
from autobucket.engine.sampling.inverse_cdf import UnsamplableRows, sample_inverse_cdf
from autobucket.engine.sampling.streams import request_seeds, stream_uniforms
from autobucket.engine.sampling.warpers import warp_logits

__all__ = ["UnsamplableRows", "first_argmax", "request_seeds", "sample_inverse_cdf", "stream_uniforms", "warp_logits"]
