"""Response classes named for what they send, so ``/openapi.json`` documents the real
media type of each non-JSON route (FastAPI takes it from ``response_class``), and an
error sent as OpenAI's error envelope, through FastAPI or through a raw ASGI ``send``."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, StreamingResponse

from control.errors import APIError

if TYPE_CHECKING:
    from control.artifacts import OpenedObject


class OctetStreamResponse(StreamingResponse):
    """A downloaded file of any type (job artifacts)."""

    media_type = "application/octet-stream"


class EventStreamResponse(StreamingResponse):
    """Server-Sent Events (``text/event-stream``)."""

    media_type = "text/event-stream"


def body_content(*media_types: str, description: str) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a 200 whose body is one of ``media_types`` (raw bytes, not JSON)."""
    binary = {"schema": {"type": "string", "format": "binary"}}
    return {200: {"description": description, "content": {m: binary for m in media_types}}}


def attachment(opened: OpenedObject, *, filename: str, media_type: str = "application/octet-stream",
               headers: dict[str, str] | None = None) -> StreamingResponse:
    """A download of an opened object: its own length, whatever happens to it meanwhile."""
    return StreamingResponse(opened.chunks, media_type=media_type, headers={
        "Content-Length": str(opened.size), "Content-Disposition": f'attachment; filename="{filename}"',
        **(headers or {})})


def error_response(exc: APIError) -> JSONResponse:
    """``exc`` as a JSON response in the error envelope."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def send_error(exc: APIError, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """Answer ``exc`` through a raw ASGI ``send`` (pure ASGI middlewares, outside FastAPI's
    exception handlers)."""
    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in (exc.headers or {}).items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
