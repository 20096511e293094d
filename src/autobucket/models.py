"""Model loading: random-weight tiny configs for tests and benchmarks (no download needed).

Each tiny model is built from a config with a fixed seed, so every process gets the same weights.
`initializer_range=0.2` keeps greedy outputs varied (0.02 collapses them to a few tokens), which is
what lets an oracle test notice a wrong mask or position."""

from __future__ import annotations

from typing import Any

import torch

# name -> (transformers config class name, config kwargs)
_TINY_BASE = {"vocab_size": 1024, "initializer_range": 0.2, "max_position_embeddings": 2048}
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("LlamaConfig", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, **_TINY_BASE}),
    "tiny-qwen2": ("Qwen2Config", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, **_TINY_BASE}),
    "tiny-qwen3": ("Qwen3Config", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, **_TINY_BASE}),
    "tiny-mistral": ("MistralConfig", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "sliding_window": None,
        "num_attention_heads": 4, "num_key_value_heads": 2, **_TINY_BASE}),
    "tiny-opt": ("OPTConfig", {
        "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "word_embed_proj_dim": 64, "init_std": 0.2, "vocab_size": 1024, "max_position_embeddings": 2048,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}),
    "tiny-gpt2": ("GPT2Config", {
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 2048, "vocab_size": 1024,
        "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2}),
    # The 20.3M-parameter benchmark model of ENVIRONMENT.md (hidden 256, 4 layers, 4 heads, 2 KV heads).
    "bench-qwen2": ("Qwen2Config", {
        "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000,
        "initializer_range": 0.2, "max_position_embeddings": 4096}),
}


def build_tiny_model(
    name: str, seed: int = 0, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
) -> torch.nn.Module:
    """A random-weight causal LM from `TINY_CONFIGS`, identical for the same name and seed."""
    import transformers

    if name not in TINY_CONFIGS:
        raise ValueError(f"model {name!r} is unknown: choose one of {', '.join(sorted(TINY_CONFIGS))}")
    class_name, kwargs = TINY_CONFIGS[name]
    config = getattr(transformers, class_name)(**kwargs)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(dtype).eval()


def load_model(
    name: str, dtype: torch.dtype | str = torch.float32, trust_remote_code: bool = False, attn_implementation: str = "sdpa"
) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) for a tiny config name, or a local path / HF id via `from_pretrained`.

    Tiny random-weight models have no tokenizer (None): pass token ids to them.
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if name in TINY_CONFIGS:
        return build_tiny_model(name, dtype=dtype, attn_implementation=attn_implementation), None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        name, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
    )
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    return model.eval(), tokenizer
