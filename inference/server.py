"""The inference worker's HTTP face: ``POST /v1/generate`` (NDJSON stream), ``POST /v1/preload``
and ``GET /healthz``.

Every request must carry the shared secret (``protocol.SECRET_HEADER``); the worker
listens on the loopback interface by default. A generation runs on its own thread
(``engine.Generation``) and hands its events to the event loop; nothing waits in the
thread pool, so a slow or stuck generation never blocks other requests or the health
check. The first event is awaited before answering, so a request that cannot start
(the model is still loading after the request's ``load_wait_s``, its adapter is
missing, the prompt does not fit the context) gets a plain HTTP error, and a started one
streams one JSON event per line. However the response ends -- finished, the caller
went away, the worker shuts down -- the generation is cancelled.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from inference.engine import Engine, Generation, InferenceError, ModelLoading
from inference.protocol import (
    GENERATE_PATH,
    HEALTH_PATH,
    PRELOAD_PATH,
    SECRET_HEADER,
    GenerationRequest,
    ModelRef,
    StreamEvent,
)

DEFAULT_STALL_LIMIT_S = 300.0

Item = StreamEvent | InferenceError | None


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None,
           param: str | None = None) -> JSONResponse:
    body = {"code": code, "message": message, **({"param": param} if param else {})}
    return JSONResponse(body, status_code=status, headers=headers)


def _refusal(exc: InferenceError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, ModelLoading) else None
    return _error(exc.status, exc.code, exc.message, headers, exc.param)


class _GenerationResponse(StreamingResponse):
    """A stream that cancels its generation however the response ends."""

    def __init__(self, content: AsyncIterator[str], generation: Generation, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._generation, self._content = generation, content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.cancel()
            await self._content.aclose()  # type: ignore[attr-defined]


async def _lines(first: StreamEvent, items: asyncio.Queue[Item]) -> AsyncIterator[str]:
    yield first.model_dump_json(exclude_none=True) + "\n"
    while (item := await items.get()) is not None:
        if isinstance(item, StreamEvent):
            yield item.model_dump_json(exclude_none=True) + "\n"


_GONE = object()


async def _first_unless_gone(items: asyncio.Queue[Item], request: Request) -> Item | object:
    """The generation's first item, or ``_GONE`` if the caller disconnects first (while the
    request waits for its model or its turn)."""
    first = asyncio.ensure_future(items.get())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((first, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not first.done():
            first.cancel()
    return first.result() if first.done() and not first.cancelled() else _GONE


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(engine: Engine, secret: str, *, stall_limit_s: float = DEFAULT_STALL_LIMIT_S) -> FastAPI:
    """The worker's ASGI app around ``engine``; requests without ``secret`` are 401.
    ``/healthz`` answers 503 once a generation has held a model ``stall_limit_s`` without a token."""
    if len(secret) < 16:
        raise ValueError("the inference secret must be at least 16 characters")

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.cancel_all()  # shutting down: nothing keeps computing for a caller that is gone

    app = FastAPI(title="tunefleet inference worker", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    def authorized(given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), secret.encode())

    @app.get(HEALTH_PATH)
    async def healthz(key: Annotated[str | None, Header(alias=SECRET_HEADER)] = None) -> Any:
        if not authorized(key):
            return _error(401, "unauthorized", "missing or wrong inference secret")
        stalled = engine.stalled_s()
        if stalled > stall_limit_s:
            return JSONResponse({"status": "stalled", "stalled_s": round(stalled, 1)}, status_code=503)
        return {"status": "ok", **engine.status()}

    @app.post(PRELOAD_PATH, status_code=202)
    async def preload(request: Request, key: Annotated[str | None, Header(alias=SECRET_HEADER)] = None) -> Any:
        if not authorized(key):
            return _error(401, "unauthorized", "missing or wrong inference secret")
        try:
            ref = ModelRef.model_validate(json.loads(await request.body()))
        except (ValueError, ValidationError) as exc:
            return _error(422, "invalid_request", str(exc))
        return JSONResponse({"status": engine.preload(ref)}, status_code=202)

    @app.post(GENERATE_PATH)
    async def generate(request: Request,
                       key: Annotated[str | None, Header(alias=SECRET_HEADER)] = None) -> Response:
        if not authorized(key):
            return _error(401, "unauthorized", "missing or wrong inference secret")
        try:
            body = GenerationRequest.model_validate(json.loads(await request.body()))
        except (ValueError, ValidationError) as exc:
            return _error(422, "invalid_request", str(exc))
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Item] = asyncio.Queue()

        def sink(item: Item) -> None:
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the loop is closed: the worker is exiting
                pass

        generation = engine.start(body, sink)
        first: Item | object = _GONE
        try:
            first = await _first_unless_gone(items, request)
        finally:
            if not isinstance(first, StreamEvent):  # refused, or the caller left while it waited
                generation.cancel()
        if first is _GONE:
            return Response(status_code=499)
        if isinstance(first, InferenceError):
            return _refusal(first)
        if first is None:
            return _error(503, "generation_cancelled", "the generation ended before it started")
        return _GenerationResponse(_lines(first, items), generation, media_type="application/x-ndjson")

    return app
