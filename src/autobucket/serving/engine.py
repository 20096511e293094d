"""`AsyncEngine`: requests submitted at any time, from any thread or coroutine, join one running continuous
batch on the trainer's own model.

One background thread (the loop) owns the model's forwards and the static KV cache. Each turn of the loop
(a *step*) drops the rows of aborted requests, re-prefills every row when the weights changed, admits
waiting requests into free rows, and decodes one token for every row; nothing of the model is touched
between steps, which is where `pause()` parks the loop. Every step runs under the same scope as a
`Rollout.generate` call (`Rollout.forward_scope`: autograd off, eval semantics, the configured kernels),
entered and left per step, so the trainer's own forwards on other threads are never affected.

Why a request's tokens do not depend on what else is in flight: its context is prefilled alone, its
random stream is keyed by its own seed, sample and step (`engine/sampling/streams.py`), and with
`kernels="invariant"` a decode row's logits are bitwise the same in any batch (with the default kernels
they agree with single-request `generate` token for token, as every route does).

Weights versions: the engine reads the weights' version (`engine/model_access/weight_versions.py`) at every
step and at `resume()`. A change bumps `weights_version` (an int, from 0), and every row in flight is
re-prefilled before its next token; each token records the version it was sampled under. A request whose
first token is more than `max_staleness` versions old is aborted at the change, its tokens so far returned."""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from autobucket.config import RolloutConfig, SamplingConfig
from autobucket.engine.batching.model_runner import CacheShape
from autobucket.engine.finished import StopStrings
from autobucket.engine.generation_setup import resolve_generation
from autobucket.engine.intercept.active import active
from autobucket.engine.model_access.hf_compat import attention_backend
from autobucket.engine.model_access.weight_versions import weights_version
from autobucket.engine.plan.forward_plan import ForwardPlan
from autobucket.engine.rollout import Rollout
from autobucket.profile import Profile
from autobucket.serving.handle import RequestHandle
from autobucket.serving.request import Request, RequestOutput
from autobucket.serving.running_batch import RunningBatch
from autobucket.serving.submission import Limits, build_request

DEFAULT_MAX_MODEL_LEN = 1024
STOP_MATCHERS_KEPT = 64


class AsyncEngine:
    """An asynchronous, continuously batched engine on one model (see the module docstring).

    >>> engine = AsyncEngine(model, tokenizer, max_batch=32)
    >>> handle = engine.submit(prompt_ids, SamplingConfig(max_new_tokens=64, temperature=1.0, seed=7))
    >>> output = handle.result()        # or: await handle / for chunk in handle.stream()
    >>> engine.pause(); optimizer.step(); engine.resume()   # requests in flight continue on new weights
    >>> engine.close()

    max_batch: most rows decoded at once (more requests wait). max_model_len: the most tokens a request's
    prompt, earlier tokens and budget may hold (default min(1024, the model's positions)); the static cache
    holds 2 x max_model_len columns per row, since a wide admission moves every row's front. max_staleness:
    abort requests whose first token is more than this many weights versions old (None: never).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        config: RolloutConfig | None = None,
        max_batch: int = 32,
        max_model_len: int | None = None,
        max_staleness: int | None = None,
    ) -> None:
        self.rollout = Rollout(model, tokenizer, config)
        self.model, self.tokenizer = self.rollout.model, tokenizer
        self.max_staleness = _checked_optional_int("max_staleness", max_staleness, 0)
        self.limits = Limits(self.model, tokenizer, self.rollout.vocab_size, self._model_len(max_model_len))
        shape = CacheShape(_checked_optional_int("max_batch", max_batch, 1), 2 * self.limits.max_model_len)
        pad = resolve_generation(self.model, SamplingConfig(), {}, self.limits.vocab_size).pad_token_id
        config = self.rollout.config
        self._new_batch = lambda: RunningBatch(
            self.model, self.rollout.spec, shape, pad, self.limits.vocab_size, config.packing, config.prefill_max_tokens
        )
        self.batch = self._new_batch()
        self._control = threading.Condition()
        self._pending: deque[Request] = deque()
        self._live: dict[str, Request] = {}
        # matchers of the latest stop strings (building one reads the whole vocabulary); bounded, so a
        # server's clients each sending their own strings cannot grow it without end
        self._stop_matcher = functools.lru_cache(maxsize=STOP_MATCHERS_KEPT)(functools.partial(StopStrings, tokenizer))
        self._pause_requested = self._parked = self._closed = self._stale = False
        self._weights = self._weights_key()
        self._version = 0
        self._profile = Profile(route="async")
        self._plan: ForwardPlan | None = None  # the steps' forward plan, chosen at the first and after a change
        self._thread = threading.Thread(target=self._loop, name="autobucket-async-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the caller's side
    @property
    def weights_version(self) -> int:
        """How many weight changes the engine has seen (0 at creation)."""
        with self._control:
            return self._version

    @property
    def paused(self) -> bool:
        with self._control:
            return self._pause_requested

    def submit(
        self,
        prompt: Any,
        sampling: SamplingConfig | None = None,
        request_id: str | None = None,
        sample: int = 0,
        generated: Sequence[int] = (),
        **overrides: Any,
    ) -> RequestHandle:
        """Queue one request; it joins the batch at the loop's next step.

        prompt: token ids, text or chat messages (with the tokenizer). sampling: its `SamplingConfig` (n=1,
        one int budget: its new tokens). sample: its index among its prompt's samples (its stream key with
        the seed). generated: tokens it made before (resuming an aborted request: submit its prompt and its
        tokens so far; it continues exactly as if it had not stopped). overrides: GenerationConfig fields
        and generate()'s `logits_processor` / `prefix_allowed_tokens_fn`, as `Rollout.generate` takes them
        (each processor sees this request's own ids, prompt and tokens so far, as in a single-request
        `generate`)."""
        request = build_request(self.limits, prompt, sampling, request_id, sample, generated, self._stop_matcher, overrides)
        with self._control:
            if self._closed:
                raise RuntimeError("the engine is closed: create a new AsyncEngine")
            earlier = self._live.get(request.request_id)
            if earlier is not None and not earlier.done:  # a finished one waits only to be forgotten
                raise ValueError(f"request_id={request.request_id!r} is already in flight: pass a new id, or None")
            self._live[request.request_id] = request
            self._pending.append(request)
            self._control.notify_all()
        return RequestHandle(request, self.abort)

    def abort(self, request_id: str) -> bool:
        """End a request now with finish reason "abort" and its tokens so far (its row is freed at the next
        step). False when no such request is in flight."""
        with self._control:
            request = self._live.pop(request_id, None)
            self._control.notify_all()
        if request is None:
            return False
        request.finish("abort")
        return True

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request in flight; their results (tokens so far)."""
        with self._control:
            requests = list(self._live.values())
        for request in requests:
            self.abort(request.request_id)
        return [RequestHandle(r, self.abort).result() for r in requests]

    def pause(self, timeout: float | None = None) -> None:
        """Stop the loop at a step boundary and return once it is parked: nothing touches the model until
        `resume()`. Submissions and aborts are still accepted meanwhile."""
        with self._control:
            self._pause_requested = True
            self._control.notify_all()
            if not self._control.wait_for(lambda: self._parked or self._closed, timeout):
                raise TimeoutError(f"the engine's loop did not reach a step boundary within {timeout} s")

    def resume(self) -> int:
        """Let the loop run again; requests in flight continue on the weights as they are now (their K/V
        recomputed when the weights changed). Returns the weights version."""
        with self._control:
            self._follow_weights()
            self._pause_requested = False
            self._control.notify_all()
            return self._version

    def close(self, timeout: float | None = 60.0) -> None:
        """Abort what is in flight and stop the loop thread (idempotent)."""
        with self._control:
            self._closed = True
            requests = list(self._live.values())
            self._live.clear()
            self._control.notify_all()
        for request in requests:
            request.finish("abort")
        self._thread.join(timeout)

    def __enter__(self) -> AsyncEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def serve(self, host: str = "127.0.0.1", port: int = 0, model_name: str | None = None):
        """An OpenAI-compatible HTTP server on this engine, on a background thread (`serving/server.py`);
        returns it running (`.url`, `.close()`). Loopback only."""
        from autobucket.serving.server import EngineServer

        return EngineServer(self, host, port, model_name).start()

    # ------------------------------------------------------------ the loop's side
    def _loop(self) -> None:
        while True:
            admitted = self._wait_for_work()
            if admitted is None:
                break
            try:
                self._step(admitted)
            except BaseException as error:  # the model's error goes to every request it stopped, unchanged
                self._fail(admitted, error)
            del admitted  # waiting for the next step must not keep this step's finished records alive
        self.batch = self._new_batch()  # the cache's memory goes back (its first insert allocates it)

    def _wait_for_work(self) -> list[Request] | None:
        """The requests to admit at the next step, after any pause; None once closed."""
        with self._control:
            while True:
                self._control.wait_for(lambda: self._closed or self._pause_requested or self._pending or self.batch.requests)
                if self._closed:
                    return None
                if not self._pause_requested:
                    break
                self._parked = True
                self._control.notify_all()
                self._control.wait_for(lambda: self._closed or not self._pause_requested)
                self._parked = False
            admitted = []
            while self._pending and len(admitted) < self.batch.free_rows:
                request = self._pending.popleft()
                if not request.done:
                    admitted.append(request)
            return admitted

    def _step(self, admitted: list[Request]) -> None:
        with self._control:
            self._follow_weights()
            version, stale, self._stale = self._version, self._stale, False
        # the plan is chosen again only when the model changed (its weights key covers what it reads:
        # modules, dtype, device, hooks, adapters, attention backend), as a call chooses it once
        with self.rollout.forward_scope(self._profile, None if stale else self._plan):
            self._plan = active().plan
            self.batch.follow_plan(self._plan, model_changed=stale)
            self.batch.remove(lambda request: request.done, "abort")
            if stale:
                self.batch.reprefill(version)
            self.batch.admit([request for request in admitted if not request.done], version)
            if self.batch.requests:
                self.batch.step(version)
        self._forget_finished(admitted)

    def _forget_finished(self, admitted: list[Request]) -> None:
        with self._control:
            for request in [*admitted, *self._live.values()]:
                if request.done and self._live.get(request.request_id) is request:
                    del self._live[request.request_id]

    def _fail(self, admitted: list[Request], error: BaseException) -> None:
        """End the requests in the batch with the model's error; the engine goes on with a fresh cache."""
        for request in [*self.batch.requests, *admitted]:
            request.finish(None, error)
        self.batch = self._new_batch()
        self._forget_finished(admitted)

    def _follow_weights(self) -> None:
        """Bump the version when the weights changed (call with `_control` held): rows in flight are then
        re-prefilled, and requests older than `max_staleness` versions aborted."""
        key = self._weights_key()
        if key == self._weights:
            return
        self._weights, self._version, self._stale = key, self._version + 1, True
        if self.max_staleness is None:
            return
        for request in list(self._live.values()):
            started = request.started_version
            if started is not None and self._version - started > self.max_staleness:
                del self._live[request.request_id]
                request.finish("abort")

    def _weights_key(self) -> tuple:
        return weights_version(self.model, attention_backend(self.model), self.rollout.kernel_choice.kernels)

    def _model_len(self, max_model_len: int | None) -> int:
        positions = self.rollout.max_positions
        if max_model_len is None:
            return min(DEFAULT_MAX_MODEL_LEN, positions) if positions else DEFAULT_MAX_MODEL_LEN
        length = _checked_optional_int("max_model_len", max_model_len, 2)
        if positions is not None and length > positions:
            raise ValueError(f"max_model_len={length} passes the model's {positions} positions: pass at most {positions}")
        return length


def _checked_optional_int(name: str, value: int | None, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: pass an int >= {minimum}")
    return value
