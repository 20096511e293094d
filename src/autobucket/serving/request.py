"""One record per request, from submission to result: what it asked for, what it has made so far, and
how it ended. The engine's loop thread is the only writer; handles read it under their lock.

A request is one sequence: prompt 0 of a call of its own, sample `sample` of it. Its random stream is
keyed as `Rollout.generate([prompt], SamplingConfig(seed=..., n=...))` keys that call's sample `sample`,
and its step counter starts at `len(generated)`: so a request resumed by submitting the tokens it had
already made (`generated`) draws the same uniforms it would have drawn had it never stopped."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from autobucket.config import SamplingConfig
from autobucket.engine.finished import StopStrings
from autobucket.engine.generation_setup import ResolvedSampling
from autobucket.engine.selection import Selection
from autobucket.serving.progress import Progress

FINISH_REASONS = ("eos", "stop", "length", "abort")


@dataclass(frozen=True)
class StreamChunk:
    """What a request made since the last chunk its reader saw (`finish_reason` set on the last one)."""

    tokens: list[int]
    logprobs: list[float] | None
    versions: list[int]
    finish_reason: str | None


@dataclass(frozen=True)
class RequestOutput:
    """A request's result (or a snapshot of it while it runs: `finish_reason` None).

    tokens: the ids made by this submission (after `generated`, which it does not repeat).
    logprobs: one per token when asked for (`SamplingConfig.logprobs`), else None.
    versions: per token, the engine's weights version it was sampled under (`AsyncEngine.weights_version`).
    finish_reason: "eos", "stop", "length" or "abort"; None while it runs.
    """

    request_id: str
    prompt_ids: list[int]
    tokens: list[int]
    logprobs: list[float] | None
    versions: list[int]
    finish_reason: str | None


@dataclass
class Request:
    """The engine's record of one request (the loop thread writes it; handles read it under their lock)."""

    request_id: str
    prompt_ids: list[int]  # as submitted: the ids before `generated`
    generated: list[int]  # tokens made before this submission (a resumed request's), prefilled with the prompt
    sampling: SamplingConfig
    generation: ResolvedSampling  # without stream keys (rows that select alike share one call)
    stream_key: int  # its random stream's key: `request_seeds(sampling.seed, 1)[0]`
    sample: int  # which sample of its prompt: the stream's sample key
    stops: StopStrings | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    started_version: int | None = None  # the weights version of its first token (`max_staleness`)
    error: BaseException | None = None  # what the model raised while it ran (re-raised to its readers)
    progress: Progress = field(default_factory=Progress)

    @functools.cached_property
    def prompt_key(self) -> tuple[int, ...]:
        """Its prompt ids as a key: requests with equal keys may read one copy of the prompt's K/V."""
        return tuple(self.prompt_ids)

    @property
    def selection(self) -> Selection:
        return self.generation.selection

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def context(self) -> list[int]:
        """What the model has read before its next token: prompt, earlier tokens and its own so far."""
        return [*self.prompt_ids, *self.generated, *self.tokens]

    @property
    def own_ids(self) -> list[int]:
        """Its context after the prompt (the tokens it was resumed with and its own so far): what a row
        reading its prompt's shared copy holds itself."""
        return [*self.generated, *self.tokens]

    @property
    def steps_before(self) -> int:
        """Tokens made before this submission: the first step of its random stream."""
        return len(self.generated)

    @property
    def budget(self) -> int:
        return int(self.sampling.max_new_tokens)

    def output(self) -> RequestOutput:
        """A snapshot (call with `progress.condition` held)."""
        return RequestOutput(
            self.request_id,
            list(self.prompt_ids),
            list(self.tokens),
            list(self.logprobs) if self.sampling.logprobs else None,
            list(self.versions),
            self.finish_reason,
        )

    def chunk_from(self, start: int) -> StreamChunk:
        """Its tokens from `start` on (call with `progress.condition` held)."""
        logprobs = list(self.logprobs[start:]) if self.sampling.logprobs else None
        return StreamChunk(list(self.tokens[start:]), logprobs, list(self.versions[start:]), self.finish_reason)

    def add_token(self, token: int, logprob: float | None, version: int) -> bool:
        """Append one token (False, nothing added: it has ended already, aborted meanwhile)."""
        with self.progress.condition:
            if self.done:
                return False
            self.tokens.append(token)
            if logprob is not None:
                self.logprobs.append(logprob)
            self.versions.append(version)
            if self.started_version is None:
                self.started_version = version
            self.progress.changed()
        return True

    def finish(self, reason: str | None, error: BaseException | None = None) -> None:
        """End it (once: a later call changes nothing) with a finish reason, or with the model's error."""
        with self.progress.condition:
            if self.done:
                return
            self.finish_reason, self.error = reason, error
            self.progress.changed(final=True)

    def reason_to_finish(self, stopped: bool) -> str | None:
        """Why its newest token ends it (EOS, a completed stop string, its budget), or None."""
        if self.tokens[-1] in self.selection.eos_token_ids:
            return "eos"
        if stopped:
            return "stop"
        if len(self.tokens) >= self.budget:
            return "length"
        return None
