"""Response classes named for what they send, so ``/openapi.json`` documents the real
media type of each non-JSON route (FastAPI takes it from ``response_class``)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import StreamingResponse


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
