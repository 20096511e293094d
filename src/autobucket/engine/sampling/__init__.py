"""The parts of token selection (`engine/selection.py` puts them together for every route): random streams
keyed by a request's identity, HF's warpers, the inverse-CDF sampler and the first-argmax."""
