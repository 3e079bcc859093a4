"""The error every layer raises: an answer with an HTTP status and a stable code.

Raised by the control plane's rules (the job lifecycle, artifacts, registries, report
ingestion) and by the routes alike; ``api.errors`` turns it into OpenAI's error envelope
on the wire. Nothing here knows HTTP frameworks, so the worker raises and catches it too.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answer with a stable code; raise it from routes and query functions."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(status, "api_error")
        self.details = details
        self.headers = headers

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        if self.details:
            error["details"] = self.details
        return {"error": error}


def not_found(kind: str, object_id: str, *, param: str | None = None) -> APIError:
    """The 404 for a missing object (also for another tenant's: isolation, not 403)."""
    return APIError(404, "not_found", f"No {kind} found with id '{object_id}'.", param=param)
