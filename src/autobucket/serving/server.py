"""The OpenAI-compatible HTTP server on an `AsyncEngine` (FastAPI + uvicorn), and its lifecycle.

Endpoints: POST /v1/completions (text or token ids; logprobs, n, stream), POST /v1/chat/completions (the
tokenizer's chat template), POST /generate (token ids in, token ids, logprobs, finish reason and weights'
versions out), POST /abort, GET /health, GET /v1/models.

Bad input is a 400 naming the field (pydantic's check of the body, or the engine's own ValueError from
`submit`), never a 500, and nothing of it reaches the engine. A client that disconnects aborts its
requests, freeing their rows. `EngineServer.close()` aborts what this server has in flight and stops
uvicorn's thread. The server binds loopback addresses only: it runs inside a trainer's process and has
no authentication."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from autobucket.prompts import conversation_ids
from autobucket.serving.handle import RequestHandle
from autobucket.serving.openai_shapes import (
    TextDecoder,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
)
from autobucket.serving.request import RequestOutput
from autobucket.serving.schemas import AbortRequest, ChatCompletionRequest, CompletionRequest, GenerateRequest

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class EngineServer:
    """uvicorn serving `build_app(engine)` on a background thread."""

    def __init__(self, engine: Any, host: str = "127.0.0.1", port: int = 0, model_name: str | None = None) -> None:
        import uvicorn

        if host not in LOOPBACK_HOSTS:
            raise ValueError(f"host={host!r}: the server has no authentication, so it binds loopback only: pass one of {LOOPBACK_HOSTS}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port={port!r} is invalid: pass 0 (a free port) to 65535")
        self.engine, self.host = engine, host
        self.app = build_app(engine, model_name or default_model_name(engine.model))
        config = uvicorn.Config(
            self.app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=5
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="autobucket-server", daemon=True)
        self.port = port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> EngineServer:
        """Start serving and return once the socket listens (the port chosen when 0 was asked for)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port} (is the port taken?)")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Abort this server's requests in flight and stop serving (idempotent)."""
        for request_id in list(self.app.state.in_flight):
            self.engine.abort(request_id)
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def default_model_name(model: Any) -> str:
    return getattr(model.config, "_name_or_path", None) or getattr(model.config, "model_type", None) or "autobucket"


def build_app(engine: Any, model_name: str) -> FastAPI:
    app = FastAPI(title="autobucket", docs_url=None, redoc_url=None, **_telemetry_off())
    app.state.in_flight = set()
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValueError, _bad_value)
    app.add_exception_handler(TypeError, _bad_value)
    _add_routes(app, engine, model_name)
    return app


def _telemetry_off() -> dict[str, Any]:
    """FastAPI's native OpenTelemetry off, where this FastAPI has it: otherwise every request asks the
    global providers (and the environment) whether tracing is configured, for a loopback server."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


def _add_routes(app: FastAPI, engine: Any, model_name: str) -> None:
    tokenizer = engine.tokenizer

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "weights_version": engine.weights_version, "paused": engine.paused}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "autobucket"}]}

    @app.post("/abort")
    async def abort(body: AbortRequest) -> dict:
        if body.all:
            return {"aborted": [o.request_id for o in engine.abort_all()]}
        return {"aborted": [body.request_id] if engine.abort(body.request_id) else []}

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
        if body.sampling_params.n != 1:
            raise ValueError(f"sampling_params.n={body.sampling_params.n}: /generate makes one sequence; send one call per sample")
        sampling = body.sampling_params.sampling(body.logprobs)
        handle = engine.submit(body.prompt_ids, sampling, request_id=body.request_id, sample=body.sample, generated=body.generated)
        app.state.in_flight.add(handle.request_id)
        [output] = await _results_or_abort(app, request, [handle])
        return JSONResponse({
            "request_id": output.request_id, "token_ids": output.tokens, "logprobs": output.logprobs,
            "finish_reason": output.finish_reason, "versions": output.versions,
            "weights_version": engine.weights_version,
        })  # fmt: skip

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        handles = _submit_samples(app, engine, body.prompt, body.sampling(body.logprobs is not None), body.n, completion_id)
        if body.stream:
            events = _completion_events(app, handles, completion_id, model_name, tokenizer)
            return StreamingResponse(events, media_type="text/event-stream")
        outputs = await _results_or_abort(app, request, handles)
        return JSONResponse(completion_body(completion_id, model_name, outputs, tokenizer))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        body = body.budget_applied()
        messages = [message.model_dump() for message in body.messages]
        prompt = conversation_ids(tokenizer, messages, "messages")
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        handles = _submit_samples(app, engine, prompt, body.sampling(body.logprobs), body.n, completion_id)
        if body.stream:
            return StreamingResponse(_chat_events(app, handles, completion_id, model_name, tokenizer), media_type="text/event-stream")
        outputs = await _results_or_abort(app, request, handles)
        return JSONResponse(chat_body(completion_id, model_name, outputs, tokenizer))


def _submit_samples(app: FastAPI, engine: Any, prompt: Any, sampling: Any, n: int, completion_id: str) -> list[RequestHandle]:
    """The n samples of one prompt as n engine requests (equal prompts share one prefill)."""
    handles = []
    try:
        for sample in range(n):
            handles.append(engine.submit(prompt, sampling, request_id=f"{completion_id}-{sample}", sample=sample))
            app.state.in_flight.add(handles[-1].request_id)
    except BaseException:
        _abort_unfinished(handles)
        raise
    return handles


async def _results_or_abort(app: FastAPI, request: Request, handles: Sequence[RequestHandle]) -> list[RequestOutput]:
    """The handles' results; a client that disconnects first aborts them (freeing their rows)."""
    results = asyncio.ensure_future(asyncio.gather(*(handle.wait() for handle in handles)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not results.done():
            _abort_unfinished(handles)
        return await results
    finally:
        gone.cancel()
        _forget(app, handles)


async def _disconnected(request: Request) -> None:
    """Return when the client goes away. The body has been read, so the server's next message on this
    request is its disconnect (what Starlette's streaming response listens for): awaited, not polled."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _merged_chunks(handles: Sequence[RequestHandle]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, chunk) from every handle as each is made."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for chunk in handle:
                await queue.put((index, chunk, None))
        except Exception as error:  # the model's error ends the stream
            await queue.put((index, None, error))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        open_streams = len(handles)
        while open_streams:
            index, chunk, error = await queue.get()
            if error is not None:
                raise error
            open_streams -= chunk.finish_reason is not None
            yield index, chunk
    finally:
        for task in tasks:
            task.cancel()


async def _completion_events(app: FastAPI, handles, completion_id: str, model: str, tokenizer: Any) -> AsyncIterator[str]:
    decoders = [TextDecoder(tokenizer) for _ in handles]
    try:
        async for index, chunk in _merged_chunks(handles):
            text = decoders[index].add(chunk.tokens, final=chunk.finish_reason is not None)
            body = completion_chunk(completion_id, model, index, text, chunk.tokens, chunk.logprobs, chunk.finish_reason)
            yield _event(body)
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away mid-stream (the response is cancelled)
        _abort_unfinished(handles)
        _forget(app, handles)


async def _chat_events(app: FastAPI, handles, completion_id: str, model: str, tokenizer: Any) -> AsyncIterator[str]:
    decoders = [TextDecoder(tokenizer) for _ in handles]
    try:
        for index in range(len(handles)):
            yield _event(chat_chunk(completion_id, model, index, {"role": "assistant", "content": ""}, [], None))
        async for index, chunk in _merged_chunks(handles):
            text = decoders[index].add(chunk.tokens, final=chunk.finish_reason is not None)
            yield _event(chat_chunk(completion_id, model, index, {"content": text}, chunk.tokens, chunk.finish_reason))
        yield "data: [DONE]\n\n"
    finally:
        _abort_unfinished(handles)
        _forget(app, handles)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _abort_unfinished(handles: Sequence[RequestHandle]) -> None:
    for handle in handles:
        if not handle.done():
            handle.abort()


def _forget(app: FastAPI, handles: Sequence[RequestHandle]) -> None:
    for handle in handles:
        app.state.in_flight.discard(handle.request_id)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    problems = [_problem(item) for item in error.errors()]
    return _error_response("; ".join(problems), "invalid_request_error")


async def _bad_value(request: Request, error: Exception) -> JSONResponse:
    return _error_response(str(error), "invalid_request_error")


def _problem(item: dict) -> str:
    where = ".".join(str(part) for part in item.get("loc", ()) if part != "body") or "body"
    value = item.get("input")
    shown = "" if isinstance(value, dict) or value is None else f" (got {value!r})"
    return f"{where}: {item.get('msg', 'invalid')}{shown}"


def _error_response(message: str, kind: str) -> JSONResponse:
    return JSONResponse(status_code=400, content={"error": {"message": message, "type": kind, "code": 400}})
