"""Models whose attention forward writes the kernels hub's variable, for the compile-across-threads tests."""

from __future__ import annotations

import pytest
import torch


def kernelized_attention_model(seed: int) -> torch.nn.Module:
    """A tiny Qwen2 of an MLP width (96 + seed) no other test compiles, so its decode step really compiles
    where it is used (dynamo reuses code across model instances of equal shapes); skips where this
    transformers' attention forward does not write the kernels hub's variable."""
    import transformers

    from autobucket.models import TINY_CONFIGS

    class_name, kwargs = TINY_CONFIGS["tiny-qwen2"]
    config = getattr(transformers, class_name)(**{**kwargs, "intermediate_size": 96 + seed})
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config).eval()
    if "_kernel_funcs" not in vars(model.model.layers[0].self_attn):  # `use_kernelized_func`'s instances
        pytest.skip("this transformers' attention forward does not write the kernels hub's variable")
    return model
