"""`AutobucketRollout` against DeepSpeed's own `HybridEngineRollout` (ordinary route) on one real
DeepSpeed engine (CPU accelerator, gloo, ZeRO stage 0, a client SGD optimizer).

Oracle: HybridEngineRollout's `RolloutBatch`, tensor for tensor (ids, masks, response starts, dtypes),
greedy, n = 1 and n > 1, on every autobucket route; after an optimizer step, both again. The tokenizer's
EOS and pad ids are tokens the model really generates, so the EOS cut and the pad-id masking rule are
exercised. Sampling cannot match DeepSpeed's (a different random stream); there the checks are route
invariance and a different seed changing the tokens.

The first `init_distributed` compiles DeepSpeed's shared-memory op (~90 s, cached in
~/.cache/torch_extensions), so the engine is built once per module."""

from __future__ import annotations

import os
import random
import socket
from types import SimpleNamespace

import pytest

pytest.importorskip("deepspeed")

import torch  # noqa: E402
from workloads import VOCAB, firing_eos_candidates  # noqa: E402

from autobucket import RolloutConfig, SamplingConfig  # noqa: E402
from autobucket.models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT_LENGTHS = (200, 5, 9, 3)  # one long prompt: auto's choice then depends on n
MAX_NEW_TOKENS = 12
_DIST_ENV = ("DS_ACCELERATOR", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ds():
    """(deepspeed, engine): one real engine for the module; the process group and env are undone after."""
    saved = {key: os.environ.get(key) for key in _DIST_ENV}
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_tiny_model("tiny-qwen2")
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}},
    )
    yield deepspeed, engine
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def left_padded(prompts: list[list[int]], pad_id: int):
    from deepspeed.runtime.rollout import RolloutRequest

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return RolloutRequest(prompt_ids=ids, prompt_attention_mask=mask)


@pytest.fixture(scope="module")
def workload(ds):
    """(request, tokenizer): EOS and pad ids are tokens that greedy decoding emits mid-response."""
    _, engine = ds
    rng = random.Random(11)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = engine.module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(prompt) :].tolist())
    candidates = firing_eos_candidates(outputs)
    assert len(candidates) >= 2, "need two tokens that appear mid-response: change the prompts"
    tokenizer = SimpleNamespace(eos_token_id=candidates[0], pad_token_id=candidates[1])
    return left_padded(prompts, tokenizer.pad_token_id), tokenizer


def assert_same_batch(got, want) -> None:
    for field in ("input_ids", "attention_mask", "response_start_idx"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{field}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        rows = [r for r in range(a.shape[0]) if not torch.equal(a[r], b[r])] if a.dim() == 2 else []
        assert torch.equal(a, b), f"{field} differs in rows {rows}"


def sampling(**kwargs):
    from deepspeed.runtime.rollout import SamplingConfig

    return SamplingConfig(**{"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, **kwargs})


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("route", ["ordinary", "equal_width", "aligned", "auto"])
def test_greedy_batch_matches_hybrid_engine(route, n, ds, workload):
    from deepspeed.runtime.rollout import HybridEngineRollout

    from autobucket.integrations.deepspeed import AutobucketRollout

    _, engine = ds
    request, tokenizer = workload
    want = HybridEngineRollout(engine, tokenizer).generate(request, sampling(n_samples_per_prompt=n))
    response = want.input_ids[:, request.prompt_ids.shape[1] :]
    assert (response == tokenizer.eos_token_id).any(dim=1).sum() >= 1, "no row ends at EOS: weak workload"
    assert ((response == tokenizer.pad_token_id) & (want.attention_mask[:, request.prompt_ids.shape[1] :] == 0)).any()
    ours = AutobucketRollout(engine, tokenizer, RolloutConfig(route=route))
    assert_same_batch(ours.generate(request, sampling(n_samples_per_prompt=n)), want)
    assert ours.last_result.route == route or (route == "auto" and ours.last_result.route in ("ordinary", "bucketed"))


def test_sampling_is_route_invariant_and_seeded(ds, workload):
    from autobucket.integrations.deepspeed import AutobucketRollout

    _, engine = ds
    request, tokenizer = workload
    settings = sampling(temperature=1.0, top_k=-1, top_p=0.95, n_samples_per_prompt=2)
    batches = [AutobucketRollout(engine, tokenizer, RolloutConfig(route=r)).generate(request, settings)
               for r in ("ordinary", "aligned")]
    assert_same_batch(batches[1], batches[0])
    other_seed = AutobucketRollout(engine, tokenizer, RolloutConfig(route="ordinary"), seed=1)
    assert not torch.equal(other_seed.generate(request, settings).input_ids, batches[0].input_ids)


def tokens_outside_min_p(model, request, rows, n, min_p: float) -> int:
    """Generated tokens HF's MinPLogitsWarper filters on a teacher-forced forward (temperature 1, no top-k/p)."""
    from transformers import MinPLogitsWarper

    outside = 0
    for row, tokens in enumerate(rows):
        prompt = request.prompt_ids[row // n][request.prompt_attention_mask[row // n].bool()].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        kept = torch.isfinite(MinPLogitsWarper(min_p)(None, logits))  # [steps, vocab]
        outside += int((~kept[torch.arange(len(tokens)), torch.tensor(tokens)]).sum())
    return outside


def test_model_generation_config_warpers_apply_when_sampling(ds, workload, monkeypatch):
    """HybridEngineRollout's `module.generate` applies the model's generation_config min_p when sampling;
    so does AutobucketRollout. Oracle: HF's MinPLogitsWarper; without min_p the kept set is left."""
    from autobucket.integrations.deepspeed import AutobucketRollout

    _, engine = ds
    request, tokenizer = workload
    settings = sampling(temperature=1.0, top_k=-1, top_p=1.0, n_samples_per_prompt=3)
    rows = {}
    for min_p in (0.1, None):
        with monkeypatch.context() as patch:
            patch.setattr(engine.module.generation_config, "min_p", min_p)
            ours = AutobucketRollout(engine, tokenizer, RolloutConfig(route="aligned"))
            ours.generate(request, settings)
            rows[min_p] = ours.last_result.flat_tokens()
    assert tokens_outside_min_p(engine.module, request, rows[0.1], 3, 0.1) == 0
    assert tokens_outside_min_p(engine.module, request, rows[None], 3, 0.1) > 0  # negative control
    with monkeypatch.context() as patch:  # a warper autobucket lacks: refused when sampling, inert when greedy
        patch.setattr(engine.module.generation_config, "top_h", 0.5, raising=False)
        with pytest.raises(ValueError, match=r"generation_config sets top_h=0\.5, which autobucket cannot apply"):
            AutobucketRollout(engine, tokenizer).generate(request, settings)
        AutobucketRollout(engine, tokenizer).generate(request, sampling())


@pytest.mark.parametrize("route", ["ordinary", "aligned"])
def test_model_min_new_tokens_is_inert_as_in_hybrid_engine(route, ds, workload, monkeypatch):
    """HybridEngineRollout runs `module.generate` with eos_token_id=None, so a generation_config
    min_new_tokens never masks EOS there; AutobucketRollout matches it tensor for tensor. Negative control:
    the same min_new_tokens through autobucket's own SamplingConfig does mask EOS and changes rows."""
    from deepspeed.runtime.rollout import HybridEngineRollout

    from autobucket.integrations.deepspeed import AutobucketRollout

    _, engine = ds
    request, tokenizer = workload
    monkeypatch.setattr(engine.module.generation_config, "min_new_tokens", MAX_NEW_TOKENS)
    want = HybridEngineRollout(engine, tokenizer).generate(request, sampling())
    assert (want.input_ids[:, request.prompt_ids.shape[1] :] == tokenizer.eos_token_id).any()  # EOS not masked
    ours = AutobucketRollout(engine, tokenizer, RolloutConfig(route=route))
    assert_same_batch(ours.generate(request, sampling()), want)
    masked = ours.rollout.generate_padded(
        request.prompt_ids, request.prompt_attention_mask,
        SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, eos_token_id=[tokenizer.eos_token_id]),
    )  # fmt: skip
    assert tokenizer.eos_token_id not in {token for row in masked.tokens for token in row}


def test_sync_weights_after_optimizer_step_follows_new_weights(ds, workload):
    from deepspeed.runtime.rollout import HybridEngineRollout

    from autobucket.integrations.deepspeed import AutobucketRollout

    _, engine = ds
    request, tokenizer = workload
    ours, hybrid = AutobucketRollout(engine, tokenizer), HybridEngineRollout(engine, tokenizer)
    before = ours.generate(request, sampling(n_samples_per_prompt=2))
    saved = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    try:
        loss = engine(input_ids=before.input_ids, attention_mask=before.attention_mask, labels=before.input_ids).loss
        engine.backward(loss)
        engine.step()
        ours.sync_weights(1)
        after = ours.generate(request, sampling(n_samples_per_prompt=2))
        assert not torch.equal(after.input_ids, before.input_ids), "the step did not change the greedy output"
        assert_same_batch(after, hybrid.generate(request, sampling(n_samples_per_prompt=2)))
    finally:
        engine.module.load_state_dict(saved)


# ------------------------------------------------------------------ bad input
def test_empty_request_is_rejected(ds, workload):
    from autobucket.integrations.deepspeed import AutobucketRollout

    _, engine = ds
    request, tokenizer = workload
    empty = type(request)(prompt_ids=request.prompt_ids[:0], prompt_attention_mask=request.prompt_attention_mask[:0])
    with pytest.raises(ValueError, match="the rollout request is empty"):
        AutobucketRollout(engine, tokenizer).generate(empty, sampling())


def test_prompt_longer_than_context_is_rejected(ds, workload):
    from autobucket.integrations.deepspeed import AutobucketRollout

    _, engine = ds
    _, tokenizer = workload
    request = left_padded([[5] * 2045, [6] * 4], tokenizer.pad_token_id)  # 2048 positions; +12 does not fit
    with pytest.raises(ValueError, match=r"prompt 0 has 2045 tokens; with max_new_tokens=12"):
        AutobucketRollout(engine, tokenizer).generate(request, sampling())


def test_unsupported_settings_are_rejected(ds, workload):
    from autobucket.integrations.deepspeed import AutobucketRollout

    _, engine = ds
    request, tokenizer = workload
    with pytest.raises(ValueError, match="n_samples_per_prompt=0 is invalid"):
        AutobucketRollout(engine, tokenizer).generate(request, sampling(n_samples_per_prompt=0))
    with pytest.raises(ValueError, match="engine of type str has no .module"):
        AutobucketRollout("engine", tokenizer)
    with pytest.raises(ValueError, match="neither pad_token_id nor eos_token_id"):
        AutobucketRollout(engine, SimpleNamespace(pad_token_id=None, eos_token_id=None))


def test_autobucket_sampling_config_is_refused_with_what_to_pass(ds, workload):
    """autobucket's own SamplingConfig (its `n`, not DeepSpeed's `n_samples_per_prompt`) raised an
    AttributeError deep inside; now a TypeError names DeepSpeed's SamplingConfig, as does an object lacking
    its fields, and the same rollout then still gives HybridEngineRollout's batch."""
    from deepspeed.runtime.rollout import HybridEngineRollout

    from autobucket.integrations.deepspeed import AutobucketRollout

    _, engine = ds
    request, tokenizer = workload
    ours = AutobucketRollout(engine, tokenizer, RolloutConfig(route="aligned"))
    with pytest.raises(TypeError, match=r"autobucket's SamplingConfig.*deepspeed\.runtime\.rollout import Sampling"):
        ours.generate(request, SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, n=2, temperature=1.0))
    with pytest.raises(TypeError, match=r"sampling of type SimpleNamespace has no temperature, top_p, top_k, n_samp"):
        ours.generate(request, SimpleNamespace(max_new_tokens=MAX_NEW_TOKENS, continuous_batch_size=None))
    assert ours.last_result is None  # nothing ran
    want = HybridEngineRollout(engine, tokenizer).generate(request, sampling(n_samples_per_prompt=2))
    assert_same_batch(ours.generate(request, sampling(n_samples_per_prompt=2)), want)


@pytest.mark.parametrize("route", ["ordinary", "auto"])
def test_invariant_logprobs_equal_the_engines_own_forward_bitwise(route, ds, workload):
    """`last_logprobs` against the engine's teacher-forced forward of the returned batch under
    `autobucket.invariant(engine.module)`: bitwise on every generated token; the same forward without the
    scope (the negative control) differs somewhere."""
    import autobucket
    from autobucket.engine.batching.prefill import positions_from_mask
    from autobucket.integrations.deepspeed import AutobucketRollout

    _, engine = ds
    request, tokenizer = workload
    rollout = AutobucketRollout(engine, tokenizer, RolloutConfig(route=route, kernels="invariant"))
    batch = rollout.generate(request, sampling(temperature=1.0, top_k=-1, top_p=1.0, n_samples_per_prompt=2))
    lengths = [len(tokens) for tokens in rollout.last_result.flat_tokens()]
    start = request.prompt_ids.shape[1]
    # Every generated token is attended, also one equal to the pad id (the batch's mask hides it from the
    # loss only); `generated` marks the response columns that hold a token.
    mask, generated = batch.attention_mask.clone(), torch.zeros(rollout.last_logprobs.shape, dtype=torch.bool)
    for row, length in enumerate(lengths):
        mask[row, start : start + length] = 1
        generated[row, :length] = True

    def engine_logprobs(scoped: bool) -> torch.Tensor:
        with torch.no_grad(), (autobucket.invariant(engine.module) if scoped else torch.no_grad()):
            logits = engine.module(input_ids=batch.input_ids, attention_mask=mask,
                                   position_ids=positions_from_mask(mask)).logits  # fmt: skip
        return autobucket.trainer_logprobs(logits[:, start - 1 : -1], batch.input_ids[:, start:], 1.0)

    scoped = engine_logprobs(True)
    assert torch.equal(scoped[generated], rollout.last_logprobs[generated])
    assert not torch.equal(engine_logprobs(False)[generated], rollout.last_logprobs[generated])
