"""The README's Python API, line for line as the README shows it, for `make typecheck` (mypy --strict).

Never run, only checked: each README statement appears here verbatim (tests/project/test_defaults.py checks
that), with the names the README leaves to the reader (`input_ids`, `attention_mask`, `prompts`) defined
and the result fields annotated with the types a user relies on."""

from __future__ import annotations

import torch

import autobucket
from autobucket import Rollout, RolloutConfig, SamplingConfig, load_model

model, tokenizer = load_model("smollm2")  # or a path / HF id / "tiny-qwen2"; keywords: the CLI's --model flags
model, tokenizer = load_model("tiny-qwen2", dtype="bfloat16", device="cpu", attn_implementation="eager", threads=1)
rollout = Rollout(model, tokenizer, RolloutConfig(route="auto"))  # costs: learned online (or a calibration JSON)
sampling = SamplingConfig(max_new_tokens=64, continuous_batch_size=32, repetition_penalty=1.0)

result = rollout.generate(["Say hello.", [1, 690, 198, 283]], sampling)  # strings, id lists, 1-D tensors
tokens: list[list[int]] = result.tokens
finish_reasons: list[str] = result.finish_reasons
route: str = result.route
predicted_ms: float | None = result.profile.predicted_ms
measured_ms: float = result.profile.measured_ms
tokens_per_s: float = result.profile.tokens_per_s

# The RL-trainer layout: left-padded ids + mask in, right-padded responses + mask out.
input_ids = torch.ones((2, 4), dtype=torch.long)
attention_mask = torch.ones_like(input_ids)
result = rollout.generate_padded(input_ids, attention_mask, sampling)
responses, response_mask = result.to_padded(pad_id=tokenizer.pad_token_id)

# Sampling for RL.
prompts: list[str | list[int]] = ["Say hello.", [1, 690, 198, 283]]
sampling = SamplingConfig(max_new_tokens=256, temperature=1.0, top_k=0, top_p=0.95, seed=1234, n=8, logprobs=True)
result = rollout.generate(prompts, sampling)
p, s = 0, 7
sample: list[int] = result.tokens[p][s]
assert result.logprobs is not None  # None unless SamplingConfig(logprobs=True): a checker asks for this
sample_logprobs: list[float] = result.logprobs[p][s]

# Compiled decode step.
rollout = Rollout(model, tokenizer, RolloutConfig(route="auto", compile=True))  # or "auto"; default False
rollout = Rollout(model, tokenizer, RolloutConfig(route="auto", compile="auto", persist_costs=False))

# Zero sampler-trainer mismatch: the rollout's kernels in the trainer's forward.
rollout = Rollout(model, config=RolloutConfig(kernels="invariant"))
rollout = Rollout(model, tokenizer, RolloutConfig(kernels="invariant"))
result = rollout.generate(prompts, SamplingConfig(temperature=1.0, logprobs=True, max_new_tokens=256))
ids, mask, prompt_width = input_ids, attention_mask, 2
with autobucket.invariant(model):
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
logps = autobucket.trainer_logprobs(logits[:, prompt_width - 1 : -1], ids[:, prompt_width:], 1.0)

# Multi-turn: the prefix cache.
rollout = Rollout(model, tokenizer, RolloutConfig(prefix_cache_mb=1024))
conversations = [[1, 9690, 198, 2683], [1, 9690, 198, 4093]]
turn = SamplingConfig(max_new_tokens=64, stop_strings=["</tool_call>"])
first = rollout.generate(conversations, turn)
tool_ids = [[28, 1421], [28, 310, 77]]
conversations = [c + t + x for c, t, x in zip(conversations, first.tokens, tool_ids, strict=True)]
left = [256 - len(t) for t in first.tokens]
second = rollout.generate(conversations, SamplingConfig(max_new_tokens=left, stop_strings=["</tool_call>"]))
cached: int = second.profile.cached_prompt_tokens
