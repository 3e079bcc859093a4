"""Response classes named for what they send, so ``/openapi.json`` documents the real
media type of each non-JSON route (FastAPI takes it from ``response_class``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse

if TYPE_CHECKING:
    from api.artifacts import OpenedObject


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
