"""The shape of verl's rollout-server adapter over `AsyncEngine`: a thin layer, so that a verl plugin (a later
step) only registers it.

verl's fully asynchronous trainer sends each sample as its own `generate(prompt_ids, sampling_params,
request_id)`, stops generation around a weight sync (`abort_all_requests`, then `resume_generation`) and
resumes an aborted request by sending its prompt plus its tokens so far under the same request id. Here
that resubmission continues the request exactly, sampled ones included: the adapter remembers each aborted
request's tokens, and a resubmission that extends them is submitted with `generated=` (its random stream
continues at the right step). `sleep` / `wake_up` pause and resume the engine: its weights are the
trainer's own, so there is nothing to offload or reload."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autobucket.serving.engine import AsyncEngine
from autobucket.serving.request import RequestOutput
from autobucket.serving.schemas import SamplingFields


@dataclass(frozen=True)
class TokenOutput:
    """verl's `TokenOutput`: the new token ids, their logprobs, why it stopped, and per token the weights
    version it was sampled under."""

    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: str  # "completed" | "aborted"
    versions: list[int]


class VerlServerAdapter:
    """verl's server-adapter methods on one engine."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._aborted: dict[str, tuple[list[int], list[int]]] = {}  # request id -> (prompt ids, its tokens)

    async def generate(self, prompt_ids: Sequence[int], sampling_params: dict[str, Any], request_id: str) -> TokenOutput:
        params = dict(sampling_params)
        logprobs = bool(params.pop("logprobs", False))
        sampling = SamplingFields(**params).sampling(logprobs)
        prompt, generated = self._split_resumed(list(prompt_ids), request_id)
        handle = self.engine.submit(prompt, sampling, request_id=request_id, generated=generated)
        output = await handle
        self._remember(output, generated)
        return _token_output(output)

    async def abort_all_requests(self) -> list[RequestOutput]:
        """Stop generating (the engine stays paused until `resume_generation`) and end every request in
        flight with its tokens so far."""
        self.engine.pause()
        return self.engine.abort_all()

    async def resume_generation(self) -> int:
        """Generate again, on the weights as they are now; returns the weights version."""
        return self.engine.resume()

    async def sleep(self) -> None:
        self.engine.pause()

    async def wake_up(self) -> None:
        self.engine.resume()

    def _split_resumed(self, prompt_ids: list[int], request_id: str) -> tuple[list[int], list[int]]:
        """(prompt, tokens made before) for a resubmission of an aborted request that extends its prompt with
        its tokens so far; else (the ids as sent, none)."""
        before = self._aborted.pop(request_id, None)
        if before is None:
            return prompt_ids, []
        prompt, tokens = before
        if prompt_ids[: len(prompt)] != prompt or prompt_ids[len(prompt) :] != tokens:
            return prompt_ids, []
        return prompt, tokens

    def _remember(self, output: RequestOutput, generated: list[int]) -> None:
        if output.finish_reason == "abort":
            self._aborted[output.request_id] = (output.prompt_ids, [*generated, *output.tokens])


def _token_output(output: RequestOutput) -> TokenOutput:
    reason = "aborted" if output.finish_reason == "abort" else "completed"
    return TokenOutput(output.tokens, output.logprobs, reason, output.versions)
