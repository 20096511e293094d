"""The HTTP server's request bodies (pydantic): what each endpoint accepts, checked before any engine work.

A field that fails its check becomes a 400 naming it (`server.py`); fields OpenAI defines that the engine
cannot honour (presence and frequency penalties, logit bias, top alternatives, echo, best_of) are refused by name rather than
silently ignored. Unknown fields are ignored, as OpenAI-compatible servers do (clients send extras such
as `user` or `stream_options`)."""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from autobucket.config import SamplingConfig


class SamplingFields(BaseModel):
    """The sampling options every generating endpoint shares (OpenAI's names, and vLLM's top_k / min_p /
    min_tokens / repetition_penalty / ignore_eos). temperature defaults to 1.0 as OpenAI's does; 0 is greedy."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)  # HF's, over the prompt and tokens so far
    ignore_eos: bool = False  # vLLM's: generate through EOS to max_tokens (benchmarks: every request the same length)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _refuse_what_is_not_applied(self) -> SamplingFields:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)} is not applied by this server: pass 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not applied by this server: leave it out")
        return self

    def sampling(self, logprobs: bool) -> SamplingConfig:
        """One sample's `SamplingConfig` (the engine keys each of the n samples by its index); a request
        without a seed gets a random one, shared by its n samples."""
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingConfig(
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            min_new_tokens=self.min_tokens,
            seed=seed,
            logprobs=logprobs,
            repetition_penalty=self.repetition_penalty,
            stop_strings=stops if stops is not None else [],
            eos_token_id=[] if self.ignore_eos else None,
        )


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt, as text or token ids."""

    model: str | None = None
    prompt: str | list[int]
    stream: bool = False
    logprobs: int | None = Field(None, ge=0, le=0, description="0: the sampled token's logprob (no alternatives)")
    echo: bool = False
    best_of: int | None = None

    @model_validator(mode="after")
    def _refuse_echo_and_best_of(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo=true is not supported: leave it out")
        if self.best_of not in (None, self.n):
            raise ValueError(f"best_of={self.best_of} is not supported: leave it out (n samples are all returned)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _one_prompt(cls, data: Any) -> Any:
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) != 1:
                raise ValueError(f"prompt holds {len(prompt)} prompts: send one per request (use n for samples)")
            data = {**data, "prompt": prompt[0]}
        return data


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: messages through the tokenizer's chat template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="alternatives are not computed: 0 or leave out")
    max_completion_tokens: int | None = Field(None, ge=1)

    def budget_applied(self) -> ChatCompletionRequest:
        """OpenAI's newer `max_completion_tokens` wins over `max_tokens`."""
        if self.max_completion_tokens is None:
            return self
        return self.model_copy(update={"max_tokens": self.max_completion_tokens})


class GenerateRequest(BaseModel):
    """POST /generate: token ids in, token ids out (an RL trainer's or verl's server adapter's call).
    `generated`: tokens the request made before (resuming an aborted one continues it exactly)."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingFields = Field(default_factory=SamplingFields)
    request_id: str | None = Field(None, min_length=1)
    sample: int = Field(0, ge=0)
    generated: list[int] = Field(default_factory=list)
    logprobs: bool = False


class AbortRequest(BaseModel):
    """POST /abort: one request by id, or every request in flight (`all`)."""

    model_config = ConfigDict(extra="forbid")

    request_id: str | None = Field(None, min_length=1)
    all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> AbortRequest:
        if (self.request_id is None) == (not self.all):
            raise ValueError("pass either request_id or all=true")
        return self
