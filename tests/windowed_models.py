"""Tiny random-weight models attending in a sliding window, every layer or one of two (kept per process:
tests must not change them)."""

from __future__ import annotations

SLIDING_WINDOW = 16
WINDOWED_BASE = {
    "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.2, "max_position_embeddings": 2048,
}  # fmt: skip
# name -> (config class, its window keywords): every layer windowed, or one of two (Gemma 3, Qwen2).
WINDOWED_CONFIGS = {
    "mistral": ("MistralConfig", {"sliding_window": SLIDING_WINDOW}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": SLIDING_WINDOW,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": SLIDING_WINDOW, "max_window_layers": 1}),
}  # fmt: skip
_WINDOWED_MODELS: dict = {}


def windowed_model(name: str, attn_implementation: str = "sdpa"):
    """A tiny random-weight model of `WINDOWED_CONFIGS[name]` attending in a 16-token sliding window (kept
    per process: tests must not change it)."""
    if (name, attn_implementation) not in _WINDOWED_MODELS:
        import torch
        import transformers

        class_name, window = WINDOWED_CONFIGS[name]
        config = getattr(transformers, class_name)(**WINDOWED_BASE, **window)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        _WINDOWED_MODELS[name, attn_implementation] = model.eval()
    return _WINDOWED_MODELS[name, attn_implementation]

