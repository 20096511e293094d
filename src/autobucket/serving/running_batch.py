"""`RunningBatch`: the rows the asynchronous engine decodes, on one `ModelRunner` and one static KV cache
kept for the engine's life.

It reuses the continuous-batching parts `Rollout.generate` runs (`ModelRunner.prefill`, `insert`,
`decode_logits`, `retire`, `Selection`), but its rows come and go between any two steps: an admission
prefills each distinct context once, alone (so its K/V and first token do not depend on what else is in
flight), and copies it into one cache row per request that shares it.

Re-prefill (after a weight update): every row's K/V is dropped and its context (prompt, earlier tokens and
its own so far) prefilled again under the new weights; its next token comes from that prefill, exactly
as if the request had been submitted afresh with its tokens so far."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from autobucket.engine.batching.model_runner import CacheShape, ModelRunner, RowInsert
from autobucket.engine.batching.static_cache import fill_holes_order
from autobucket.engine.intercept.attention import AttentionFunction
from autobucket.engine.model_access.hf_compat import ForwardSpec
from autobucket.serving.request import Request
from autobucket.serving.token_choice import choose_tokens


class RunningBatch:
    """Active requests, one per cache row (in row order)."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: ForwardSpec,
        shape: CacheShape,
        pad_token_id: int,
        vocab_size: int,
        decode_attention: AttentionFunction | None,
    ) -> None:
        self.runner = ModelRunner(
            model, spec, shape, pad_token_id, vocab_size, track_seen=False, decode_attention=decode_attention
        )
        self.requests: list[Request] = []

    @property
    def free_rows(self) -> int:
        return self.runner.cache_shape.continuous_batch_size - len(self.requests)

    def admit(self, requests: Sequence[Request], version: int) -> None:
        """Prefill each distinct context once and start its requests' rows (a request whose first token
        ends it finishes without a row)."""
        by_context: dict[tuple[int, ...], list[Request]] = {}
        for request in requests:
            by_context.setdefault(tuple(request.context), []).append(request)
        for context, members in by_context.items():
            output, _ = self.runner.prefill([list(context)])
            logits = output.last_logits[torch.zeros(len(members), dtype=torch.long, device=self.runner.device)]
            tokens, logprobs = choose_tokens(members, logits)
            host = tokens.tolist()
            keep = [b for b, request in enumerate(members) if not self._record(request, host[b], logprobs[b], version)]
            if keep:
                index = torch.tensor(keep, dtype=torch.long, device=self.runner.device)
                self.runner.insert(output, RowInsert([0] * len(keep), tokens[index], [len(context)] * len(keep), None))
                self.requests.extend(members[b] for b in keep)

    def step(self, version: int) -> None:
        """One decode step of every row; finished requests leave their rows."""
        self.runner.prepare_decode()
        logits = self.runner.decode_logits()
        tokens, logprobs = choose_tokens(self.requests, logits)
        self.runner.advance(tokens)
        host = tokens.tolist()  # the one host sync of the step
        finished = {r for r, request in enumerate(self.requests) if self._record(request, host[r], logprobs[r], version)}
        self._retire(lambda r: r not in finished)

    def remove(self, leaving: Callable[[Request], bool], reason: str) -> list[Request]:
        """Free the rows of the requests `leaving` picks, finished with `reason`; returns them."""
        gone = [request for request in self.requests if leaving(request)]
        if gone:
            self._retire(lambda r: not leaving(self.requests[r]))
            for request in gone:
                request.finish(reason)
        return gone

    def reprefill(self, version: int) -> None:
        """Recompute every row's K/V under the weights as they are now (see the module docstring)."""
        requests = self.clear()
        self.admit(requests, version)

    def clear(self) -> list[Request]:
        """Drop every row (nothing finished); returns their requests, in row order."""
        requests = self.requests
        if self.runner.store is not None:
            self._retire(lambda r: False)
        self.requests = []
        return requests

    def _record(self, request: Request, token: int, logprob: float | None, version: int) -> bool:
        """Add `token` to `request`; True when that finished it, or it had ended already (aborted from
        another thread while this step ran: the token is dropped)."""
        if not request.add_token(token, logprob, version):
            return True
        stopped = request.stops is not None and request.stops.completed(
            [([*request.prompt_ids, *request.generated], request.tokens)]
        )[0]
        reason = request.reason_to_finish(stopped)
        if reason is not None:
            request.finish(reason)
        return reason is not None

    def _retire(self, stays: Callable[[int], bool]) -> None:
        keep = fill_holes_order([r for r in range(len(self.requests)) if stays(r)])
        self.runner.retire(keep)
        self.requests = [self.requests[r] for r in keep]
