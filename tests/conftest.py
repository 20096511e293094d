"""Shared fixtures for the engine tests: tiny models built once per session, and the oracle.

The oracle is single-request `model.generate` (greedy, explicit all-ones mask): the one thing every
route must reproduce token for token. Oracle results are cached per (model, prompt, settings) so
the many route tests that share a workload pay for `generate` once.
"""

from __future__ import annotations

import os

# The Triton kernels' tests run them on CPU tensors through Triton's interpreter, which triton takes from the
# environment when it is first imported: set before any test module (or torch's inductor) imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import functools
import random
import weakref
from collections.abc import Sequence

import pytest

ARCHS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-opt", "tiny-gpt2")
ROUTES = ("ordinary", "equal_width", "aligned")
CB_ROUTES = ("equal_width", "aligned")
VOCAB = 1024

# model -> {(prompt, max_new_tokens, penalty, eos ids): (tokens, reason)}; weak, so a freed model's id
# can never serve another model's answers
_ORACLE_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class TinyModels:
    """Builds each tiny model on first use and keeps it for the session (same seed: same weights).

    The models are shared by every test (and their oracle answers are cached), so a test that changes
    one must work on a copy: `changed_models` names any model whose weights, buffers, config or mode
    differ from when it was built, and the autouse `shared_state_unchanged` fails the test that did it.
    """

    def __init__(self) -> None:
        self._models: dict[tuple[str, str], object] = {}
        self._built_as: dict[tuple[str, str], tuple[dict, str, bool]] = {}

    def forget(self) -> None:
        """Drop every built model: each is rebuilt, as it was first built, on its next use."""
        self._models.clear()
        self._built_as.clear()

    def __call__(self, name: str, attn_implementation: str = "sdpa"):
        from autobucket.models import build_tiny_model

        key = (name, attn_implementation)
        if key not in self._models:
            model = build_tiny_model(name, attn_implementation=attn_implementation)
            self._models[key] = model
            self._built_as[key] = _snapshot(model)
        return self._models[key]

    def changed_models(self) -> list[str]:
        """'name (what changed)' for every built model that is no longer as it was built."""
        changed = []
        for key, model in self._models.items():
            tensors, config, training = self._built_as[key]
            what = [
                *(["weights or buffers"] if not _same_tensors(tensors, _tensors_of(model)) else []),
                *(["config"] if model.config.to_json_string() != config else []),
                *(["train/eval mode"] if model.training != training else []),
            ]
            if what:
                changed.append(f"{key[0]} [{key[1]}] ({', '.join(what)})")
        return changed


def _tensors_of(model) -> dict:
    """Parameters and every buffer (non-persistent ones too: rotary inv_freq is not in state_dict)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _snapshot(model) -> tuple[dict, str, bool]:
    tensors = {name: tensor.detach().clone() for name, tensor in _tensors_of(model).items()}
    return tensors, model.config.to_json_string(), model.training


def _same_tensors(before: dict, now: dict) -> bool:
    import torch

    return before.keys() == now.keys() and all(
        before[name].dtype == now[name].dtype and torch.equal(before[name], now[name]) for name in before
    )


_TINY_MODELS = TinyModels()


@pytest.fixture(scope="session", autouse=True)
def isolated_cache_dir(tmp_path_factory):
    """Every test runs with AUTOBUCKET_CACHE_DIR in a temporary folder, so learned costs never touch the
    real cache; the converted SmolLM2 (a slow one-time conversion) is linked in from the real cache."""
    import os
    from pathlib import Path

    from autobucket.models import CACHE_DIR_ENV, smollm2_cache_dir

    real = smollm2_cache_dir().parent
    root = tmp_path_factory.mktemp("autobucket-cache")
    if real.exists():
        (root / real.name).symlink_to(real, target_is_directory=True)
    before = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(root)
    yield Path(root)
    if before is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = before


@pytest.fixture(scope="session", autouse=True)
def threads_per_worker():
    """Under pytest-xdist (`make test`: one worker per core), each worker's torch gets its share of the
    cores: torch's default (every core) in every worker would run workers x cores threads, and OpenMP
    threads waiting for a busy core are what made tests ~10x slower on a loaded machine (single_thread).
    Tests that need more threads set them and restore them."""
    import os

    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    before = torch.get_num_threads()
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_models() -> TinyModels:
    return _TINY_MODELS


def torch_process_state() -> dict[str, object]:
    """The process-wide torch settings a test may change; a test that leaves one changed moves the
    numbers of whichever tests run after it in its process (which ones depends on the test order)."""
    import torch

    mkldnn_matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return {
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.is_grad_enabled()": torch.is_grad_enabled(),
        "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled(),
        "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
        "torch.backends.mkldnn.matmul.fp32_precision": getattr(mkldnn_matmul, "fp32_precision", None),
    }


def changed_process_state(before: dict[str, object], after: dict[str, object]) -> list[str]:
    return [f"{name}: {before[name]!r} -> {after[name]!r}" for name in before if after[name] != before[name]]


@pytest.fixture(autouse=True)
def shared_state_unchanged(request):
    """Fails the test that changed a shared tiny model (the next test would compare against it) or
    left a process-wide torch setting changed."""
    state = torch_process_state()
    yield
    leaked = changed_process_state(state, torch_process_state())
    if leaked:
        pytest.fail(f"{request.node.nodeid} left torch settings changed: {'; '.join(leaked)}; restore them")
    changed = _TINY_MODELS.changed_models()
    if changed:
        _TINY_MODELS.forget()  # rebuilt on next use, so one culprit fails once, not every later test
        _ORACLE_CACHE.clear()
        pytest.fail(f"{request.node.nodeid} changed shared tiny models: {'; '.join(changed)}; work on a copy.deepcopy")


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for the tiny models' modules (restored afterwards).

    A 64-wide model gains nothing from a second thread, and when the 2-core machine is busy, OpenMP
    workers waiting for a core made these tests ~10x slower in wall time.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


@pytest.fixture
def always_share(monkeypatch):
    """Every multi-sample prompt and shared prefix decodes over one copy of its K/V (cascade decode; by
    default it starts only when the copies saved are large, `SHARED_MIN_SAVED_COLUMNS`)."""
    from autobucket.engine import routes
    from autobucket.engine.batching import model_runner

    monkeypatch.setattr(routes, "SHARED_MIN_SAVED_COLUMNS", 0)
    monkeypatch.setattr(model_runner, "SHARED_MIN_SAVED_COLUMNS", 0)


def random_prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Prompts of the given lengths with token ids drawn from [3, vocab) (0-2 are pad/bos/eos ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for length in lengths]


@functools.cache
def byte_bpe_tokenizer():
    """A byte-level BPE tokenizer with exactly VOCAB ids, trained on a seeded synthetic corpus of the letters
    a-p and `<>/_` (no network, the same merges every run): every id a tiny model generates has text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "abcdefghijklmnop<>/_"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(4000)]
    corpus = [" ".join(words[start : start + 40]) for start in range(0, len(words), 40)]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    assert len(tokenizer) == VOCAB, "the corpus must yield a full vocabulary: change it"
    return tokenizer


BPE_CORPUS_CHARACTERS = set("abcdefghijklmnop<>/_ ")  # what byte_bpe_tokenizer's text is made of


def corpus_piece(text: str, start: int, length: int) -> str:
    """The first run of `length` corpus characters in `text` at or after `start` (else before it): a stop
    string that can fire (a lone byte token decodes to U+FFFD, which no string matches)."""
    for begin in [*range(start, len(text)), *range(start)]:
        piece = text[begin : begin + length]
        if len(piece) == length and set(piece) <= BPE_CORPUS_CHARACTERS:
            return piece
    raise AssertionError(f"no clean {length}-character piece in {text!r}: change the workload")


def stop_string_oracle(model, tokenizer, prompt, strings, max_new_tokens: int, eos_off: bool = False):
    """Single-request HF greedy generate with stop strings (`eos_off`: no EOS; else the model's own):
    the new tokens and why it ended ("eos", "stop" by HF's own criteria, or "length")."""
    import torch
    from transformers import StopStringCriteria

    input_ids = torch.tensor([list(prompt)])
    no_eos = {"eos_token_id": None, "pad_token_id": 0} if eos_off else {}
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            do_sample=False, num_beams=1, stop_strings=strings, tokenizer=tokenizer, **no_eos,
        )  # fmt: skip
    tokens = output[0, len(prompt) :].tolist()
    if not eos_off and tokens[-1] in _eos_tuple(model, None):
        return tokens, "eos"
    return tokens, "stop" if bool(StopStringCriteria(tokenizer, strings)(output, None)[0]) else "length"


def _eos_tuple(model, eos_token_id) -> tuple[int, ...]:
    value = model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def oracle_generate(
    model,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    repetition_penalty: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    min_new_tokens: int | None = None,
) -> tuple[list[int], str]:
    """Single-request greedy `model.generate`: new tokens through the first EOS inclusive, and why it stopped.

    eos_token_id None means the model's own generation_config EOS, as for the engine; [] means none.
    min_new_tokens None leaves the model's generation_config value, as the engine does.
    Other fields of the model's generation_config apply as they would in `model.generate`.
    """
    import torch

    eos = _eos_tuple(model, eos_token_id)
    cache = _ORACLE_CACHE.setdefault(model, {})
    key = (tuple(prompt_ids), max_new_tokens, float(repetition_penalty), eos, min_new_tokens)
    if key not in cache:
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        with torch.inference_mode():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                repetition_penalty=repetition_penalty,
                eos_token_id=list(eos) if eos else None,
                pad_token_id=eos[0] if eos else 0,
                **({} if min_new_tokens is None else {"min_new_tokens": min_new_tokens}),
            )
        new_tokens = output[0, input_ids.shape[1] :].tolist()
        cache[key] = _cut_at_eos(new_tokens, eos)
    tokens, reason = cache[key]
    return list(tokens), reason


def steering_hook(model):
    """A trainer's forward hook that changes a decoder layer's output (activation steering: a fixed vector
    added), so every later layer's K/V changes while no parameter does."""
    import torch

    steer = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 2

    def hook(module, args, output):
        return (output[0] + steer, *output[1:]) if isinstance(output, tuple) else output + steer

    return hook


def hf_greedy(model, prompts, max_new_tokens: int, **options) -> list[list[int]]:
    """Each prompt's `max_new_tokens` new tokens from the model's own greedy `generate` (EOS off), with
    generate `options`; not cached (`oracle_generate` is, per model: here the options or the model's
    wrapped forward are what a test varies)."""
    import torch

    rows = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        with torch.inference_mode():
            output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=None, pad_token_id=0, **options)  # fmt: skip
        rows.append(output[0, len(prompt) :].tolist())
    return rows


def teacher_forced_logprobs(model, prompt: Sequence[int], tokens: Sequence[int]):
    """[len(tokens)] fp32: each generated token's log-softmax under one forward of the whole sequence (the
    trainer's view of a sample: what trainer-mode logprobs must equal)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, *tokens]])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1)[torch.arange(len(tokens)), torch.tensor(list(tokens))]


def forget_oracle(model) -> None:
    """Drop `model`'s cached oracle answers (after its weights changed)."""
    _ORACLE_CACHE.pop(model, None)


def _cut_at_eos(tokens: list[int], eos: tuple[int, ...]) -> tuple[list[int], str]:
    for position, token in enumerate(tokens):
        if token in eos:
            return tokens[: position + 1], "eos"
    return tokens, "length"


def oracle_batch(model, prompts, max_new_tokens, repetition_penalty=1.0, eos_token_id=None):
    """`oracle_generate` for every prompt: (tokens per prompt, finish reason per prompt)."""
    pairs = [oracle_generate(model, p, max_new_tokens, repetition_penalty, eos_token_id) for p in prompts]
    return [t for t, _ in pairs], [r for _, r in pairs]


def mismatches(result_tokens, expected_tokens) -> list[int]:
    """Prompt indices whose tokens differ from the oracle's (length difference counts)."""
    assert len(result_tokens) == len(expected_tokens)
    return [
        i for i, (got, want) in enumerate(zip(result_tokens, expected_tokens, strict=True)) if got != want
    ]


def assert_matches_oracle(result, expected_tokens, expected_reasons) -> None:
    wrong = mismatches(result.tokens, expected_tokens)
    detail = "; ".join(f"prompt {i}: got {result.tokens[i]} want {expected_tokens[i]}" for i in wrong[:3])
    assert not wrong, f"{len(wrong)} of {len(expected_tokens)} prompts differ from model.generate: {detail}"
    assert result.finish_reasons == expected_reasons


def firing_eos_candidates(oracle_tokens: list[list[int]]) -> list[int]:
    """EOS ids that greedy decoding emits at step >= 2 for some prompts and never for others.

    Ordered by how many prompts first emit the token at step >= 2 (then by id), among tokens that do
    not occur at all in at least one prompt's output (so some rows still end by length).
    """
    counts: dict[int, int] = {}
    for tokens in oracle_tokens:
        seen: set[int] = set()
        for step, token in enumerate(tokens):
            if token not in seen and step >= 2:
                counts[token] = counts.get(token, 0) + 1
            seen.add(token)
    absent_somewhere = {t for t in counts if any(t not in tokens for tokens in oracle_tokens)}
    return sorted(absent_somewhere, key=lambda t: (-counts[t], t))


def choose_firing_eos(oracle_tokens: list[list[int]]) -> int:
    candidates = firing_eos_candidates(oracle_tokens)
    assert candidates, "no token fires as EOS for some prompts but not all: change the workload"
    return candidates[0]


def cut_length(tokens: list[int], eos: int) -> int:
    """How many tokens a row keeps when `eos` ends it."""
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)


COMPILE_ENV = "AUTOBUCKET_TEST_COMPILE"  # "1": RolloutConfig's default becomes compile=True


@pytest.fixture(scope="session", autouse=True)
def forced_compile():
    """With AUTOBUCKET_TEST_COMPILE=1 (`make test-compile`), the whole suite runs the compiled decode step.

    Only the default changes (the dataclass __init__'s default value), so a test that passes
    compile=False explicitly (the controls that break an eager-only code path) keeps its meaning."""
    import inspect
    import os

    if os.environ.get(COMPILE_ENV) != "1":
        yield False
        return
    from autobucket import RolloutConfig

    init = RolloutConfig.__init__
    names = list(inspect.signature(init).parameters)[1:]
    original = init.__defaults__
    index = names.index("compile") - (len(names) - len(original))
    init.__defaults__ = original[:index] + (True,) + original[index + 1 :]
    yield True
    init.__defaults__ = original
