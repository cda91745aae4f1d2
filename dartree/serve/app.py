"""The Starlette application: OpenAI's endpoints around one `DecodeWorker`.

    POST /v1/chat/completions   messages through the chat template; stream: true for SSE
    POST /v1/completions        a raw text prompt (or token ids); stream: true for SSE
    GET  /v1/models             the one served model (and /v1/models/{id})
    GET  /health                {"status": "ok", "model", "busy", "queued", "served", ...}

Every error is a JSON body in OpenAI's shape (`errors.APIError`). With an API key every request
must carry `Authorization: Bearer KEY` (compared in constant time; 401 before anything is read or
decoded). A streamed answer's headers go out with its first text, so a request that fails before
that answers 500 like an unstreamed one; a failure later ends the stream with an error event. A
client that disconnects, streamed or not, cancels its request (`Job.cancel`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .errors import APIError, error_body
from .responses import DONE, Answer, sse
from .schema import MAX_BODY_BYTES, Served, parse_request
from .worker import DecodeWorker, Job, QueueFull

def create_app(decoder, tokenizer, model_id: str, api_key: str | None = None,
               max_queue: int = 16, max_body_bytes: int = MAX_BODY_BYTES,
               default_seed: int = 0) -> Starlette:
    """The server's ASGI app; its decoder thread runs while the app's lifespan does.

    decoder:        a dartree.SpeculativeDecoder (used by the worker thread alone)
    tokenizer:      its target's tokenizer
    model_id:       the name clients pass as `model` (other names: 404)
    api_key:        None, or the key every request must carry as `Authorization: Bearer KEY`
    max_queue:      requests that may wait while one decodes; more get 429 with Retry-After
    max_body_bytes: larger request bodies get 413
    default_seed:   the sampling seed of requests without one
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    worker = DecodeWorker(decoder, tokenizer, max_queue)
    served = Served(model_id=model_id, tokenizer=tokenizer,
                    vocab_size=decoder.target.vocab_size, room=decoder.max_new_tokens_after,
                    default_seed=default_seed)
    created = int(time.time())

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": model_id, **worker.status()})

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "dartree"}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name != model_id:
            raise APIError(404, f"model {name!r} is not served here; this server serves "
                                f"{model_id!r}", "model", "model_not_found")
        return JSONResponse(model_card())

    async def chat(request: Request) -> Response:
        return await _complete(request, "chat")

    async def completions(request: Request) -> Response:
        return await _complete(request, "text")

    async def _complete(request: Request, kind: str) -> Response:
        body = await _read_json(request, max_body_bytes)
        req = parse_request(kind, body, served)
        try:
            job = worker.submit(req, asyncio.get_running_loop())
        except QueueFull as full:
            raise _Busy(str(full), full.retry_after) from None
        answer = Answer(kind, model_id)
        first = await _first_event(job, request, streamed=req.stream)
        if first is None:  # the client went away; nobody reads this
            return Response(status_code=204)
        event, value = first
        if event == "error":
            raise value
        if not req.stream:
            return JSONResponse(answer.body(value))
        return StreamingResponse(_stream(job, answer, first, req.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    routes = [Route("/health", health), Route("/v1/models", models),
              Route("/v1/models/{name:path}", model),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"])]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        APIError: _api_error, _Busy: _busy, HTTPException: _http_error, Exception: _server_error})
    app.state.worker = worker
    if api_key is not None:
        app.add_middleware(_KeyCheck, key=api_key)
    return app


async def _read_json(request: Request, limit: int):
    """The body parsed as JSON; 413 past `limit` bytes (before reading it when its length is
    declared), 400 when it is not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; the limit is {limit}",
                       code="request_too_large")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise APIError(413, f"the request body passes the limit of {limit} bytes",
                           code="request_too_large")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}",
                       code="invalid_json") from None


async def _first_event(job: Job, request: Request, streamed: bool):
    """The job's first event that answers the request: its first text (streamed), or its end
    ("done"/"error"); None, with the job cancelled, when the client disconnects first."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            nxt = asyncio.ensure_future(job.next_event())
            await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                job.cancel()
                return None
            event = nxt.result()
            if event[0] != "text" or streamed:
                return event
    except asyncio.CancelledError:
        job.cancel()
        raise
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(job: Job, answer: Answer, first, include_usage: bool):
    """The server-sent events of a streamed answer, from its first event on; cancels the job
    when the stream ends early (the client went away)."""
    ended = False
    try:
        opening = answer.first_chunk()
        if opening is not None:
            yield opening
        event, value = first
        while True:
            if event == "text":
                yield answer.text_chunk(value)
            elif event == "done":
                for chunk in answer.last_chunks(value, include_usage):
                    yield chunk
                ended = True
                return
            else:  # "error" after the headers went out: an error event ends the stream
                yield sse(value.body())
                yield DONE
                ended = True
                return
            event, value = await job.next_event()
    finally:
        if not ended:
            job.cancel()


class _Busy(Exception):
    """The queue is full: 429 with Retry-After."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.message, self.retry_after = message, retry_after


async def _api_error(request: Request, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _busy(request: Request, exc: _Busy) -> Response:
    return JSONResponse(error_body(429, exc.message, code="queue_full"), status_code=429,
                        headers={"Retry-After": str(exc.retry_after)})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (unknown path 404, wrong method 405) in OpenAI's shape."""
    what = {404: f"no such endpoint: {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}"}
    return JSONResponse(error_body(exc.status_code, what.get(exc.status_code, str(exc.detail))),
                        status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    """Any other exception: 500 (Starlette re-raises it after this, so the server logs it with
    its traceback)."""
    return JSONResponse(error_body(500, "internal server error (logged with its traceback)"),
                        status_code=500)


class _KeyCheck:
    """ASGI middleware: 401 unless the request carries `Authorization: Bearer <key>`."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key):
            return await self.app(scope, receive, send)
        message = ("invalid API key" if header else
                   "missing API key: send the header Authorization: Bearer <key>")
        response = JSONResponse(error_body(401, message, code="invalid_api_key"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
