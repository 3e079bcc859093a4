"""The inference worker's HTTP face: ``POST /v1/generate`` (NDJSON stream) and ``GET /healthz``.

Every request must carry the shared secret (``protocol.SECRET_HEADER``); the worker
listens on the loopback interface by default. The first event of a generation is taken
before answering, so a request that cannot start (the model is loading, its adapter is
missing) gets a plain HTTP error, and a started one streams one JSON event per line.
"""

from __future__ import annotations

import hmac
import itertools
import json
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from inference.engine import Engine, InferenceError, ModelLoading
from inference.protocol import GENERATE_PATH, SECRET_HEADER, GenerationRequest, StreamEvent


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"code": code, "message": message}, status_code=status, headers=headers)


def _lines(events: Iterator[StreamEvent]) -> Iterator[str]:
    for event in events:
        yield event.model_dump_json(exclude_none=True) + "\n"


def create_app(engine: Engine, secret: str) -> FastAPI:
    """The worker's ASGI app around ``engine``; requests without ``secret`` are 401."""
    if len(secret) < 16:
        raise ValueError("the inference secret must be at least 16 characters")
    app = FastAPI(title="tunefleet inference worker", docs_url=None, redoc_url=None, openapi_url=None)

    def authorized(given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), secret.encode())

    @app.get("/healthz")
    def healthz(key: Annotated[str | None, Header(alias=SECRET_HEADER)] = None) -> Any:
        if not authorized(key):
            return _error(401, "unauthorized", "missing or wrong inference secret")
        return {"status": "ok", **engine.status()}

    @app.post(GENERATE_PATH)
    async def generate(request: Request,
                       key: Annotated[str | None, Header(alias=SECRET_HEADER)] = None) -> Response:
        if not authorized(key):
            return _error(401, "unauthorized", "missing or wrong inference secret")
        try:
            body = GenerationRequest.model_validate(json.loads(await request.body()))
        except (ValueError, ValidationError) as exc:
            return _error(422, "invalid_request", str(exc))
        events = engine.generate(body)
        try:
            first = await run_in_threadpool(next, events)
        except ModelLoading as exc:
            return _error(exc.status, exc.code, exc.message, {"Retry-After": str(exc.retry_after_s)})
        except InferenceError as exc:
            return _error(exc.status, exc.code, exc.message)
        return StreamingResponse(_lines(itertools.chain([first], events)), media_type="application/x-ndjson")

    return app
