"""HTTP transport of the SDK: auth header, retries with backoff, error mapping.

Retry policy (why each case is safe):
- connect errors: the request never reached the service;
- 429 and 503: the service refused the request before doing anything;
- 502/504 and read timeouts: only for GET or requests carrying an ``Idempotency-Key``,
  because the service may have acted before the answer was lost.
Delays grow exponentially (0.5 s, 1 s, 2 s, ... capped at 8 s, with jitter) and a
``Retry-After`` header (seconds or HTTP date) overrides them, capped at 60 s. The same
``Idempotency-Key`` is sent on every attempt so a retried create never makes two jobs.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from tunefleet.sdk.errors import APIConnectionError, APITimeoutError, error_from_response
from tunefleet.version import __version__

DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
DEFAULT_MAX_RETRIES = 3
_ALWAYS_RETRY_STATUS = frozenset({429, 503})
_SAFE_RETRY_STATUS = frozenset({502, 504})
_MAX_RETRY_AFTER_S = 60.0


@dataclass
class RequestOptions:
    method: str
    path: str
    params: Mapping[str, Any] | None = None
    json: Any = None
    files: Any = None
    data: Mapping[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    timeout: httpx.Timeout | float | None = None
    # Artifact downloads may be answered with a 307 to a presigned S3 URL; httpx drops
    # the Authorization header when a redirect leaves the service's origin.
    follow_redirects: bool = False

    @property
    def replayable(self) -> bool:
        """May the request be repeated after the service may have acted on it?"""
        return self.method in ("GET", "HEAD", "OPTIONS") or "Idempotency-Key" in self.headers


def _clean_params(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if params is None:
        return None
    out: dict[str, Any] = {}
    for key, value in params.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        out[key] = value
    return out


def retry_after_seconds(response: httpx.Response | None) -> float | None:
    """The delay a ``Retry-After`` header asks for, or None."""
    if response is None:
        return None
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            parsed = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None  # neither seconds nor an HTTP date: use our own backoff
        seconds = parsed.timestamp() - time.time()
    return max(0.0, min(seconds, _MAX_RETRY_AFTER_S))


def backoff_seconds(attempt: int, response: httpx.Response | None) -> float:
    """Delay before retry number ``attempt`` (0-based)."""
    asked = retry_after_seconds(response)
    if asked is not None:
        return asked
    base = min(0.5 * (2**attempt), 8.0)
    return base * (0.75 + random.random() * 0.5)


def should_retry_status(status: int, options: RequestOptions) -> bool:
    return status in _ALWAYS_RETRY_STATUS or (status in _SAFE_RETRY_STATUS and options.replayable)


class _TransportBase:
    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None,
        timeout: httpx.Timeout | float | None,
        max_retries: int,
        default_headers: Mapping[str, str] | None,
    ) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.max_retries = max_retries
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        headers = {"User-Agent": f"tunefleet-python/{__version__}", "Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        headers.update(default_headers or {})
        self.headers = headers

    def _build(self, client: httpx.Client | httpx.AsyncClient, options: RequestOptions) -> httpx.Request:
        timeout = options.timeout if options.timeout is not None else self.timeout
        return client.build_request(
            options.method,
            options.path,
            params=_clean_params(options.params),
            json=options.json,
            files=options.files,
            data=options.data,
            headers=options.headers,
            timeout=timeout,
        )

    def _adopt_client(self, http_client: Any, client_class: type[Any]) -> Any:
        """The ``httpx`` client to send with: the caller's (pointed at the service, with the
        SDK's headers; the caller closes it) or a new one of ``client_class`` we own."""
        self._owns_client = http_client is None
        if http_client is None:
            return client_class(base_url=self.base_url, headers=self.headers)
        http_client.base_url = self.base_url
        http_client.headers.update(self.headers)
        return http_client

    def _delay_after_transport_error(self, exc: httpx.TransportError, request: httpx.Request,
                                     options: RequestOptions, attempt: int) -> float:
        """Seconds to wait before retrying after ``exc``; raises the SDK's error when no retry is left."""
        retryable = not _is_replay_unsafe_exc(exc) or options.replayable
        if retryable and attempt < self.max_retries:
            return backoff_seconds(attempt, None)
        raise _connection_error(exc, request) from exc

    def _delay_after_error_status(self, response: httpx.Response, options: RequestOptions, attempt: int) -> float:
        """Seconds to wait before retrying after an error answer (already read and closed);
        raises the SDK's error for it when it is not retried."""
        if should_retry_status(response.status_code, options) and attempt < self.max_retries:
            return backoff_seconds(attempt, response)
        raise error_from_response(response)


def _is_replay_unsafe_exc(exc: httpx.TransportError) -> bool:
    """Transport errors after which the service may already have acted."""
    return not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))


def _connection_error(exc: httpx.TransportError, request: httpx.Request) -> APIConnectionError:
    cls = APITimeoutError if isinstance(exc, httpx.TimeoutException) else APIConnectionError
    return cls(f"cannot reach {request.url}: {exc.__class__.__name__}: {exc}", request=request)


class SyncTransport(_TransportBase):
    def __init__(self, *, http_client: httpx.Client | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.client: httpx.Client = self._adopt_client(http_client, httpx.Client)

    def close(self) -> None:
        if self._owns_client:
            self.client.close()

    def request(self, options: RequestOptions) -> httpx.Response:
        """Send with retries; returns a successful response (streamed if asked) or raises."""
        attempt = 0
        while True:
            request = self._build(self.client, options)
            try:
                response = self.client.send(request, stream=options.stream,
                                            follow_redirects=options.follow_redirects)
            except httpx.TransportError as exc:
                delay = self._delay_after_transport_error(exc, request, options, attempt)
            else:
                if response.is_success:
                    return response
                response.read()
                response.close()
                delay = self._delay_after_error_status(response, options, attempt)
            time.sleep(delay)
            attempt += 1


class AsyncTransport(_TransportBase):
    def __init__(self, *, http_client: httpx.AsyncClient | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.client: httpx.AsyncClient = self._adopt_client(http_client, httpx.AsyncClient)

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    async def request(self, options: RequestOptions) -> httpx.Response:
        attempt = 0
        while True:
            request = self._build(self.client, options)
            try:
                response = await self.client.send(request, stream=options.stream,
                                                  follow_redirects=options.follow_redirects)
            except httpx.TransportError as exc:
                delay = self._delay_after_transport_error(exc, request, options, attempt)
            else:
                if response.is_success:
                    return response
                await response.aread()
                await response.aclose()
                delay = self._delay_after_error_status(response, options, attempt)
            await asyncio.sleep(delay)
            attempt += 1
