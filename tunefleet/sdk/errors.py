"""Typed exceptions of the tunefleet SDK.

Every non-2xx answer of the service carries an OpenAI-style envelope
``{"error": {"message", "type", "param", "code"}}``; the SDK turns it into one exception
class per HTTP status family so callers can ``except NotFoundError`` instead of
inspecting status numbers. Network failures that survive the retries become
``APIConnectionError``; a ``wait`` that runs out of time raises ``WaitTimeoutError``.
"""

from __future__ import annotations

from typing import Any

import httpx


class TunefleetError(Exception):
    """Base class of every error the SDK raises on purpose."""


class ConfigurationError(TunefleetError):
    """The client could not be configured (bad base URL, unreadable config file)."""


class APIConnectionError(TunefleetError):
    """The service could not be reached (connect/read failure after all retries)."""

    def __init__(self, message: str, *, request: httpx.Request | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request = request


class APITimeoutError(APIConnectionError):
    """The request timed out after all retries."""


class WaitTimeoutError(TunefleetError):
    """``jobs.wait`` / ``files.wait`` gave up before the object reached a final state."""

    def __init__(self, message: str, *, last: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.last = last


class ChecksumMismatchError(TunefleetError):
    """A downloaded artifact's sha256 differs from the one the service listed."""

    def __init__(self, name: str, expected: str, actual: str) -> None:
        super().__init__(f"artifact {name!r}: sha256 {actual} does not match the listed {expected}")
        self.name = name
        self.expected = expected
        self.actual = actual


class APIStatusError(TunefleetError):
    """The service answered with an error status.

    Attributes:
        status: the HTTP status code.
        message: the human-readable message of the error envelope.
        code: the stable machine code (e.g. ``"file_not_processed"``), or None.
        param: the request field the error refers to (e.g. ``"training_file"``), or None.
        type: the error type of the envelope (e.g. ``"invalid_request_error"``).
        body: the decoded response body (dict) or its text.
        response: the raw ``httpx.Response``.
    """

    def __init__(
        self,
        message: str,
        *,
        response: httpx.Response,
        body: Any,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.response = response
        self.status = response.status_code
        self.body = body
        self.code = code
        self.param = param
        self.type = type
        self.request_id = response.headers.get("x-request-id")

    def __str__(self) -> str:
        where = f" (param: {self.param})" if self.param else ""
        code = f" [{self.code}]" if self.code else ""
        return f"{self.status}{code}: {self.message}{where}"


class BadRequestError(APIStatusError):
    """400, 413, 415 and 422: the request is invalid; fix it before retrying."""


class AuthenticationError(APIStatusError):
    """401: missing or wrong API key."""


class PermissionDeniedError(APIStatusError):
    """403: the key is valid but may not do this (e.g. an admin-only route)."""


class NotFoundError(APIStatusError):
    """404: no such object for this tenant."""


class ConflictError(APIStatusError):
    """409: the object's state forbids this (e.g. cancelling a finished job)."""


class RateLimitError(APIStatusError):
    """429: too many requests; the SDK already retried with backoff."""


class ServerError(APIStatusError):
    """5xx: the service failed; the SDK already retried where that was safe."""


def _class_for_status(status: int) -> type[APIStatusError]:
    if status in (400, 413, 415, 422):
        return BadRequestError
    if status == 401:
        return AuthenticationError
    if status == 403:
        return PermissionDeniedError
    if status == 404:
        return NotFoundError
    if status == 409:
        return ConflictError
    if status == 429:
        return RateLimitError
    if status >= 500:
        return ServerError
    return APIStatusError


def error_from_response(response: httpx.Response) -> APIStatusError:
    """Build the typed exception for an error response (its body must already be read)."""
    body: Any
    try:
        body = response.json()
    except ValueError:
        body = response.text
    message, code, param, err_type = None, None, None, None
    if isinstance(body, dict):
        envelope = body.get("error")
        if isinstance(envelope, dict):
            message = envelope.get("message")
            code = envelope.get("code")
            param = envelope.get("param")
            err_type = envelope.get("type")
        elif isinstance(body.get("detail"), (str, list)):
            # A bare FastAPI/Starlette error that escaped the envelope (e.g. a 405).
            message = str(body["detail"])
    if not message:
        message = (body if isinstance(body, str) and body else None) or response.reason_phrase
    cls = _class_for_status(response.status_code)
    return cls(str(message), response=response, body=body, code=code, param=param, type=err_type)
