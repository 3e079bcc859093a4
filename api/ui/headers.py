"""Browser hardening headers on every dashboard response (``/ui`` pages and assets).

The pages load only their own scripts (no inline script, no ``eval``), fetch only this
origin, and may not be framed; ``X-Content-Type-Options: nosniff`` stops a browser from
running an uploaded or served text as a script or style. Styles allow ``'unsafe-inline'``
because the templates use ``style=`` attributes (they cannot run code).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CONTENT_SECURITY_POLICY = "; ".join((  # noqa: FLY002 - one directive a line reads better
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self' 'unsafe-inline'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "object-src 'none'",
    "base-uri 'none'",
    "form-action 'self'",
    "frame-ancestors 'none'",
))
HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
)


class DashboardHeadersMiddleware:
    """Adds ``HEADERS`` to responses for paths under ``prefix``."""

    def __init__(self, app: Callable[..., Any], prefix: str = "/ui") -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == self.prefix or path.startswith(self.prefix + "/")):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []),
                                      *(h for h in HEADERS if h[0] not in present)]
            await send(message)

        await self.app(scope, receive, send_with_headers)
