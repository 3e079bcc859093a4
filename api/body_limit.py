"""A cap on request bodies, enforced before routing and authentication.

Without it, a client without any key could make the API read a 60 MiB JSON body before
the 401 came back. ``BodySizeLimitMiddleware`` (pure ASGI, outside every route) answers
413 ``request_too_large`` in the OpenAI error envelope as soon as the ``Content-Length``
says too much, or as soon as a streamed body passes the limit, without reading the rest.
The file upload route keeps its own, larger streaming limit (``TUNEFLEET_MAX_UPLOAD_BYTES``,
``api/files/uploads.py``) and is exempt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from api.responses import send_error
from control.errors import APIError

Scope = dict[str, Any]
ASGIApp = Callable[..., Any]


class _BodyTooLarge(Exception):
    """Raised by the wrapped ``receive`` once the body passed the limit."""


class BodySizeLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` (routes for which ``exempt(scope)`` is true
    are left alone)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, exempt: Callable[[Scope], bool]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or self.exempt(scope):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send)
            return
        state = {"received": 0, "over": False, "started": False}

        async def limited_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > self.max_bytes:
                    state["over"] = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            if state["over"]:
                # The route turned the aborted read into some answer of its own: ours wins.
                if message["type"] == "http.response.start" and not state["started"]:
                    state["started"] = True
                    await self._refuse(send)
                return
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            if not state["started"]:
                await self._refuse(send)

    async def _refuse(self, send: Callable[..., Any]) -> None:
        await send_error(APIError(
            413, "request_too_large",
            f"The request body is larger than {self.max_bytes} bytes; send less per request.",
            headers={"Connection": "close"},
        ), send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
