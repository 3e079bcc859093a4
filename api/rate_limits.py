"""Rate limits on ``/v1/*``, ``/internal/*`` and ``/ui/login``, before routing.

Two limits, each counted in fixed one-minute windows (``limits``' fixed-window strategy):

- failed authentication per client IP (``TUNEFLEET_RATE_LIMIT_FAILED_AUTH_PER_MIN``,
  tight): counted when the answer is a 401 (a missing, invalid or revoked key, job token
  or session, a failed dashboard sign-in) and checked before the request reaches any
  route, so a client over it is answered 429 without a key lookup, whatever it sends;
- requests per caller (generous): an API key is the caller, by its public prefix (never
  the secret), with ``TUNEFLEET_RATE_LIMIT_REQUESTS_PER_MIN``; a trainer's report route
  is keyed by its job (``TUNEFLEET_RATE_LIMIT_REPORTS_PER_MIN``: trainers report in
  bursts); anything else by the client IP. Only answers other than 401 count, so a forged
  key carrying a real key's prefix spends the forger's failed-auth budget, not the key's.

A refused request gets 429 ``rate_limited`` in the error envelope with ``Retry-After``
(whole seconds until the window ends). Counters live in this process's memory (the
embedded mode: one API process) or, when the broker is Redis, in that Redis, so every
replica shares them. If the storage fails the request goes through and a warning is
logged (and the storage is left alone for a few seconds, so a Redis that hangs does not
slow every request down): the limits protect the service, they must never be what takes
it down.

The client IP is the connection's peer address; ``X-Forwarded-For`` is read only when
that peer is one of ``TUNEFLEET_RATE_LIMIT_TRUSTED_PROXIES`` (the client is then the
rightmost address that is not itself a trusted proxy).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from limits import RateLimitItem, RateLimitItemPerMinute
from limits.aio.strategies import FixedWindowRateLimiter
from limits.errors import StorageError
from limits.storage import storage_from_string

from api.errors import APIError
from api.ids import key_prefix
from api.settings import Settings

log = logging.getLogger(__name__)

Scope = dict[str, Any]
ASGIApp = Callable[..., Any]
Networks = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]

_COVERED_PREFIXES = ("/v1/", "/internal/")
_COVERED_PATHS = frozenset({"/ui/login"})
_REPORTS_PATH = re.compile(r"^/internal/v1/jobs/([^/]+)/reports$")
# A Redis that does not answer must not hold requests up for long.
_REDIS_TIMEOUT_S = 0.5
_STORAGE_RETRY_S = 5.0
_WARNING_INTERVAL_S = 60.0


@dataclass(frozen=True)
class Caller:
    """Who a request counts against: its client IP, and its per-caller bucket
    (``("key", prefix)``, ``("job", job_id)`` or ``("ip", ip)``)."""

    ip: str
    bucket: tuple[str, str]


class RateLimits:
    """The two limits and the storage their counters live in."""

    def __init__(self, settings: Settings) -> None:
        url = settings.rate_limit_storage_url
        options: dict[str, Any] = {}
        if url != "async+memory://":
            options = {"implementation": "redispy", "key_prefix": settings.rate_limit_key_prefix,
                       "socket_connect_timeout": _REDIS_TIMEOUT_S, "socket_timeout": _REDIS_TIMEOUT_S}
        self.limiter = FixedWindowRateLimiter(storage_from_string(url, wrap_exceptions=True, **options))
        self.failed_auth = RateLimitItemPerMinute(settings.rate_limit_failed_auth_per_min)
        self.requests = RateLimitItemPerMinute(settings.rate_limit_requests_per_min)
        self.reports = RateLimitItemPerMinute(settings.rate_limit_reports_per_min)
        self.trusted_proxies = settings.trusted_proxies
        self._retry_storage_at = 0.0
        self._next_warning = 0.0

    def caller(self, scope: Scope) -> Caller:
        ip = client_ip(scope, self.trusted_proxies)
        if match := _REPORTS_PATH.match(scope["path"]):
            return Caller(ip, ("job", match.group(1)))
        prefix = _bearer_key_prefix(scope)
        return Caller(ip, ("key", prefix) if prefix else ("ip", ip))

    async def retry_after(self, caller: Caller) -> int | None:
        """Seconds ``caller`` must wait before its next request, or None if it may go on."""
        if self._storage_down():
            return None
        try:
            for item, identifiers in (self._failed_auth(caller), self._budget(caller)):
                if not await self.limiter.test(item, *identifiers):
                    stats = await self.limiter.get_window_stats(item, *identifiers)
                    return max(1, math.ceil(stats.reset_time - time.time()))
        except StorageError as exc:
            self._storage_failed(exc)
        return None

    async def count(self, caller: Caller, status: int) -> None:
        """Count an answered request: a 401 against the IP's failed-auth limit, anything
        else against the caller's request budget."""
        if self._storage_down():
            return
        item, identifiers = self._failed_auth(caller) if status == 401 else self._budget(caller)
        try:
            await self.limiter.hit(item, *identifiers)
        except StorageError as exc:
            self._storage_failed(exc)

    def _failed_auth(self, caller: Caller) -> tuple[RateLimitItem, tuple[str, ...]]:
        return self.failed_auth, ("failed-auth", caller.ip)

    def _budget(self, caller: Caller) -> tuple[RateLimitItem, tuple[str, ...]]:
        return (self.reports if caller.bucket[0] == "job" else self.requests), ("requests", *caller.bucket)

    def _storage_down(self) -> bool:
        return time.monotonic() < self._retry_storage_at

    def _storage_failed(self, exc: StorageError) -> None:
        # Leave the storage alone for a while: a Redis that does not answer would otherwise
        # add its timeout to every request of the outage.
        now = time.monotonic()
        self._retry_storage_at = now + _STORAGE_RETRY_S
        if now >= self._next_warning:  # once a minute, not once per request
            self._next_warning = now + _WARNING_INTERVAL_S
            log.warning("rate limit storage unavailable, requests go through unlimited: %r",
                        exc.storage_error)


class RateLimitMiddleware:
    """Answer 429 to callers over a limit on the covered routes; count every answer."""

    def __init__(self, app: ASGIApp, *, limits: RateLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or not is_rate_limited(scope["path"]):
            await self.app(scope, receive, send)
            return
        caller = self.limits.caller(scope)
        wait_s = await self.limits.retry_after(caller)
        if wait_s is not None:
            await _refuse(send, wait_s)
            return

        async def counting_send(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                await self.limits.count(caller, message["status"])

        await self.app(scope, receive, counting_send)


def install(app: FastAPI, settings: Settings) -> None:
    """Add the rate limits to ``app`` unless ``settings`` turn them off."""
    if settings.rate_limiting:
        app.add_middleware(RateLimitMiddleware, limits=RateLimits(settings))


def client_ip(scope: Scope, trusted_proxies: Networks) -> str:
    """The client's address: the peer's, or what a trusted proxy says in X-Forwarded-For."""
    peer = (scope.get("client") or ("unknown", 0))[0]
    if not _is_within(peer, trusted_proxies):
        return peer
    hops = [hop.strip() for name, value in scope.get("headers", ()) if name == b"x-forwarded-for"
            for hop in value.decode("latin-1").split(",") if hop.strip()]
    for hop in reversed(hops):
        if not _is_within(hop, trusted_proxies):
            return hop
    return hops[0] if hops else peer


def _is_within(address: str, networks: Networks) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in networks)


def is_rate_limited(path: str) -> bool:
    """Whether requests to ``path`` (a URL path or a route's path template) are limited."""
    return path.startswith(_COVERED_PREFIXES) or path in _COVERED_PATHS


def _bearer_key_prefix(scope: Scope) -> str | None:
    """The public prefix of a ``Bearer`` API key (not yet verified), or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return key_prefix(token.strip()) if scheme.lower() == "bearer" else None
    return None


async def _refuse(send: Callable[..., Any], wait_s: int) -> None:
    await APIError(
        429, "rate_limited",
        f"Too many requests (or failed authentications) from this client; retry after {wait_s} s.",
        headers={"Retry-After": str(wait_s)},
    ).send_asgi(send)
