"""DeepSpeed's rollout interface served by autobucket (`pip install "autobucket[deepspeed]"`, deepspeed 0.19.8).

`AutobucketRollout(engine, tokenizer)` is a `deepspeed.runtime.rollout.RolloutEngine`: a DeepSpeed user
swaps `HybridEngineRollout(engine, tokenizer)` for it and keeps the rest of the loop, DeepSpeed's own
`SamplingConfig` included (autobucket's `SamplingConfig` is refused with a TypeError saying what to pass:
translating it would drop the fields DeepSpeed's interface has no place for, such as seed and stop strings).

Output layout = `HybridEngineRollout`'s ordinary route, tensor for tensor, so downstream code cannot
tell them apart in greedy decoding:
- rows prompt-major (`n_samples_per_prompt` samples of prompt 0, then prompt 1, ...);
- `input_ids` = the request's left-padded prompt ids (as given) + a response of exactly
  `max_new_tokens` columns: tokens through the tokenizer's first EOS, then the pad id;
- `attention_mask` = the request's prompt mask, then 1 on response tokens, 0 after the first EOS and on
  any generated token equal to the pad id (unless it is that first EOS);
- `response_start_idx` = the prompt width for every row.
`continuous_batch_size` is honoured as autobucket's row limit (None: all rows at once); the layout stays
the ordinary route's even then (DeepSpeed's own CB path would narrow responses to the longest one).

Generation runs through `autobucket.Rollout` on `engine.module`, never through DeepSpeed's own
continuous-batching path (which breaks on transformers >= 5.14). Weights are read live, so
`sync_weights(step)` only records the step, which keys the sampling streams: sampled tokens depend on
(seed, step, call, prompt, sample), not on the route or batch plan. At ZeRO stage 3 each call gathers the
full weights once on every rank and generates with no collectives (`zero3_weights.py`): every rank
calls `generate` together, and a call one rank refuses raises on every rank after it, with the reason."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from deepspeed.runtime.rollout import RolloutBatch, RolloutEngine, RolloutRequest
from deepspeed.runtime.rollout import SamplingConfig as DeepSpeedSamplingConfig

from autobucket import Rollout, RolloutConfig, SamplingConfig
from autobucket.checks import optional_int, require_int
from autobucket.engine.generation_setup import eos_token_ids
from autobucket.engine.model_access.rank_failures import distributed_ready, failures_shared
from autobucket.integrations.generation_options import reject_unsupported_warpers, warper_settings
from autobucket.integrations.zero3_weights import gathered_zero3, zero_stage
from autobucket.result import RolloutResult


class AutobucketRollout(RolloutEngine):
    """A `RolloutEngine` over a DeepSpeed engine's module, generating with autobucket.

    engine: the `DeepSpeedEngine` (any ZeRO stage); its `.module` is the Hugging Face causal LM.
    tokenizer: anything with `pad_token_id` and `eos_token_id` (pad falls back to EOS, as in DeepSpeed).
    config: how autobucket runs (default `RolloutConfig(route="auto")`).
    seed: base of the sampling streams (with the step from `sync_weights` and a per-step call count).
    After each call, `last_result` holds autobucket's `RolloutResult` (route, profile, finish reasons).
    """

    name = "autobucket"

    def __init__(self, engine: Any, tokenizer: Any, config: RolloutConfig | None = None, seed: int = 0) -> None:
        _check_engine(engine)
        self.engine = engine
        self.tokenizer = tokenizer
        self.pad_token_id = _pad_token_id(tokenizer)
        self.eos_token_ids = eos_token_ids(tokenizer.eos_token_id)
        self.rollout = Rollout(engine.module, None, config if config is not None else RolloutConfig(route="auto"))
        self.seed = seed
        self.step = 0
        self._calls_this_step = 0
        self.last_result: RolloutResult | None = None
        self.last_logprobs: torch.Tensor | None = None  # [B * n, max_new_tokens] float32, see the module docstring

    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: DeepSpeedSamplingConfig) -> RolloutBatch:
        sharded = zero_stage(self.engine) == 3 and distributed_ready()
        with failures_shared(sharded):  # before the gather, which a rank refusing here would not join
            rows, n = request.prompt_ids.shape[0], _check_sampling(sampling)
            if rows == 0:
                raise ValueError("the rollout request is empty (prompt_ids has 0 rows): pass at least one prompt")
            settings = self._sampling(sampling, rows * n)
        # at stage 3 the gather is the call's one collective; a refusal inside the call (the prompts'
        # checks) is shared after it, when every rank has released the gathered weights
        with failures_shared(sharded), gathered_zero3(self.engine):
            result = self.rollout.generate_padded(request.prompt_ids.cpu(), request.prompt_attention_mask.cpu(), settings)
        self.last_result = result
        self.last_logprobs = _response_logprobs(result, n, sampling.max_new_tokens, request.prompt_ids.device)
        return _rollout_batch(request, result.flat_tokens(), n, sampling.max_new_tokens, self.pad_token_id, self.eos_token_ids)

    def sync_weights(self, step: int) -> None:
        """Weights are shared with the training engine (read live); the step keys the sampling streams."""
        self.step = int(step)
        self._calls_this_step = 0

    def _sampling(self, sampling: DeepSpeedSamplingConfig, total_rows: int) -> SamplingConfig:
        generation_config = self.rollout.model.generation_config
        penalty = getattr(generation_config, "repetition_penalty", None)
        warping = {"temperature": 0.0}
        if sampling.temperature > 0:
            _check_model_warpers(generation_config)
            # HybridEngineRollout's `module.generate` fills what DeepSpeed's SamplingConfig lacks (min_p,
            # typical_p, the cutoffs) from the model's generation_config, as it does the penalty.
            warping = {"temperature": float(sampling.temperature), "top_k": max(int(sampling.top_k), 0),
                       "top_p": float(sampling.top_p), **warper_settings(generation_config)}
        return SamplingConfig(
            max_new_tokens=sampling.max_new_tokens,
            continuous_batch_size=sampling.continuous_batch_size or total_rows,
            repetition_penalty=1.0 if penalty is None else float(penalty),  # HF generate applies the model's
            eos_token_id=list(self.eos_token_ids),
            # HybridEngineRollout generates with eos_token_id=None and cuts at the first EOS afterwards,
            # so HF never applies the model's generation_config min_new_tokens (it masks EOS ids only)
            min_new_tokens=0,
            seed=self._next_seed(),
            n=sampling.n_samples_per_prompt,
            logprobs=True,
            **warping,
        )

    def _next_seed(self) -> int:
        key = f"{self.seed}/{self.step}/{self._calls_this_step}"
        self._calls_this_step += 1
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _check_engine(engine: Any) -> None:
    if not hasattr(engine, "module"):
        raise ValueError(f"engine of type {type(engine).__name__} has no .module: pass the DeepSpeedEngine")


# The fields of DeepSpeed's SamplingConfig that `generate` reads.
_DEEPSPEED_SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "n_samples_per_prompt",
                              "continuous_batch_size")  # fmt: skip


def _check_sampling_type(sampling: Any) -> None:
    """TypeError for settings that are not DeepSpeed's SamplingConfig (autobucket's own has other fields:
    `n`, not `n_samples_per_prompt`), naming what to pass."""
    fix = (
        "pass DeepSpeed's, as to HybridEngineRollout: `from deepspeed.runtime.rollout import SamplingConfig`, "
        "SamplingConfig(max_new_tokens=..., temperature=..., top_p=..., top_k=..., n_samples_per_prompt=...)"
    )
    if isinstance(sampling, SamplingConfig):
        raise TypeError(
            f"sampling is autobucket's SamplingConfig, which AutobucketRollout.generate does not take: {fix} "
            "(autobucket's n is n_samples_per_prompt there; min_p, typical_p and the repetition penalty come "
            "from the model's generation_config, as in HybridEngineRollout)"
        )
    missing = [field for field in _DEEPSPEED_SAMPLING_FIELDS if not hasattr(sampling, field)]
    if missing:
        raise TypeError(f"sampling of type {type(sampling).__name__} has no {', '.join(missing)}: {fix}")


def _check_sampling(sampling: DeepSpeedSamplingConfig) -> int:
    """The request's samples per prompt, after checking the fields autobucket reads."""
    _check_sampling_type(sampling)
    for field in ("max_new_tokens", "n_samples_per_prompt"):
        require_int(field, getattr(sampling, field))
    optional_int("continuous_batch_size", sampling.continuous_batch_size, 1, "or None for all rows at once")
    return sampling.n_samples_per_prompt


def _check_model_warpers(generation_config: Any) -> None:
    reject_unsupported_warpers(
        generation_config, "the model's generation_config sets", "set model.generation_config.{option} = None"
    )


def _pad_token_id(tokenizer: Any) -> int:
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value if isinstance(value, int) else eos_token_ids(value)[0])
    raise ValueError("the tokenizer defines neither pad_token_id nor eos_token_id: set tokenizer.pad_token_id")


def _response_logprobs(result: RolloutResult, n: int, max_new_tokens: int, device: torch.device) -> torch.Tensor:
    """The result's logprobs (per prompt, or per prompt n lists) -> [rows, max_new_tokens] float32, rows
    prompt-major as the batch's, 0.0 past each row's tokens."""
    assert result.logprobs is not None, "AutobucketRollout always asks for logprobs"
    flat = [sample for samples in result.logprobs for sample in samples] if n > 1 else list(result.logprobs)
    out = torch.zeros((len(flat), max_new_tokens), dtype=torch.float32)
    for row, values in enumerate(flat):
        out[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out.to(device)


def _rollout_batch(
    request: RolloutRequest, rows: list[list[int]], n: int, max_new_tokens: int, pad_id: int, eos_ids: tuple[int, ...]
) -> RolloutBatch:
    """Per-row generated tokens -> HybridEngineRollout's padded layout (see the module docstring)."""
    device, prompt_width = request.prompt_ids.device, request.prompt_ids.shape[1]
    response = torch.full((len(rows), max_new_tokens), pad_id, dtype=request.prompt_ids.dtype)  # [B*n, T_r]
    response_mask = torch.zeros((len(rows), max_new_tokens), dtype=torch.long)
    for row, tokens in enumerate(rows):
        response[row, : len(tokens)] = torch.as_tensor(tokens, dtype=response.dtype)
        response_mask[row, : len(tokens)] = (response[row, : len(tokens)] != pad_id).long()
        if tokens and tokens[-1] in eos_ids:  # the first EOS is a real token even when it equals the pad id
            response_mask[row, len(tokens) - 1] = 1
    prompt_ids = request.prompt_ids.repeat_interleave(n, dim=0)  # [B*n, T_p]
    prompt_mask = request.prompt_attention_mask.repeat_interleave(n, dim=0).long()
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, response.to(device)], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.to(device)], dim=1),
        response_start_idx=torch.full((len(rows),), prompt_width, dtype=torch.long, device=device),
    )
