"""Rate limits on ``/v1/*``, ``/internal/*`` and ``/ui/login``, before routing.

Two limits, each counted in fixed one-minute windows (``limits``' fixed-window strategy):

- failed authentication (``TUNEFLEET_RATE_LIMIT_FAILED_AUTH_PER_MIN``, tight), per client
  IP and per presented credential (the bearer token or dashboard cookie, by its sha256):
  counted when the answer is a 401 (a missing, invalid or revoked key, job token or
  session, a failed dashboard sign-in) and checked before the request reaches any route,
  so a client over it is answered 429 without a key lookup, whatever it sends, and a
  forged key sent from many addresses is refused too;
- requests per caller (generous). Only a caller the route has authenticated spends a
  key's or a job's budget: an API key by its public prefix
  (``TUNEFLEET_RATE_LIMIT_REQUESTS_PER_MIN``), a trainer by its job
  (``TUNEFLEET_RATE_LIMIT_REPORTS_PER_MIN``: trainers report in bursts). Everything else
  -- no credential, a forged one, or one no route looked at (an unknown path's 404, a
  wrong method's 405) -- spends the client IP's budget. The authenticating dependencies
  say who they verified (``mark_verified``), and a credential verified here before is
  checked against its owner's budget from then on (``_VerifiedCredentials``). So a forged
  key carrying a real key's prefix, or traffic to a job's report route without its token,
  never spends the real key's or the trainer's budget.

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
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from http.cookies import CookieError, SimpleCookie
from typing import Any

from fastapi import FastAPI
from limits import RateLimitItem, RateLimitItemPerMinute
from limits.aio.strategies import FixedWindowRateLimiter
from limits.errors import StorageError
from limits.storage import storage_from_string

from api.responses import send_error
from control.errors import APIError
from control.ids import hash_secret
from control.settings import Settings

log = logging.getLogger(__name__)

Scope = dict[str, Any]
ASGIApp = Callable[..., Any]
Networks = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]

_COVERED_PREFIXES = ("/v1/", "/internal/")
_COVERED_PATHS = frozenset({"/ui/login"})
_SESSION_COOKIE = "tf_session"  # the dashboard's (api/ui/session.py)
_VERIFIED_KEY = "tunefleet.verified_caller"
# A Redis that does not answer must not hold requests up for long.
_REDIS_TIMEOUT_S = 0.5
_STORAGE_RETRY_S = 5.0
_WARNING_INTERVAL_S = 60.0
# Credentials verified in this process, remembered for about one counting window.
_VERIFIED_TTL_S = 60.0
_VERIFIED_MAX = 10_000

Bucket = tuple[str, str]


@dataclass
class Verification:
    """Who the route authenticated (``("key", prefix)`` or ``("job", job_id)``), if anyone;
    one per request, set through ``mark_verified``."""

    bucket: Bucket | None = None


@dataclass(frozen=True)
class Caller:
    """Who a request counts against: its client IP, the digest of the credential it
    presents (None without one), and what the route verified."""

    ip: str
    credential: str | None
    verified: Verification = field(default_factory=Verification)

    @property
    def ip_bucket(self) -> Bucket:
        return ("ip", self.ip)


def mark_verified(scope: Scope, bucket: Bucket) -> None:
    """Record that this request authenticated as ``bucket``: its answer spends that budget.

    Called by the authenticating dependencies (``api.deps.get_current_key``,
    ``api.route_auth.job_token``) once the credential checked out.
    """
    verification = scope.get(_VERIFIED_KEY)
    if verification is not None:
        verification.bucket = bucket


class _VerifiedCredentials:
    """Credential digest -> the budget it spends, for credentials this process verified in
    the last ``_VERIFIED_TTL_S`` seconds (at most ``_VERIFIED_MAX``, oldest dropped)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: OrderedDict[str, tuple[Bucket, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: str) -> Bucket | None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None or entry[1] <= self._clock():
                return None
            return entry[0]

    def put(self, digest: str, bucket: Bucket) -> None:
        with self._lock:
            self._entries.pop(digest, None)
            self._entries[digest] = (bucket, self._clock() + _VERIFIED_TTL_S)
            while len(self._entries) > _VERIFIED_MAX:
                self._entries.popitem(last=False)


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
        self.verified = _VerifiedCredentials()
        self._retry_storage_at = 0.0
        self._next_warning = 0.0

    def caller(self, scope: Scope) -> Caller:
        caller = Caller(client_ip(scope, self.trusted_proxies), _credential_digest(scope))
        scope[_VERIFIED_KEY] = caller.verified
        return caller

    async def retry_after(self, caller: Caller) -> int | None:
        """Seconds ``caller`` must wait before its next request, or None if it may go on.

        The budget checked is the one the request will spend if it is what it was last
        time: its owner's for a credential verified here before, else its IP's.
        """
        if self._storage_down():
            return None
        known = self.verified.get(caller.credential) if caller.credential else None
        try:
            for item, identifiers in (*self._failed_auth(caller), self._budget(known or caller.ip_bucket)):
                if not await self.limiter.test(item, *identifiers):
                    stats = await self.limiter.get_window_stats(item, *identifiers)
                    return max(1, math.ceil(stats.reset_time - time.time()))
        except StorageError as exc:
            self._storage_failed(exc)
        return None

    async def count(self, caller: Caller, status: int) -> None:
        """Count an answered request: a 401 against the failed-auth limits of its IP and
        credential; anything else against the budget of whom the route verified, or of
        the IP when it verified no one."""
        verified = caller.verified.bucket
        if verified is not None and caller.credential is not None:
            self.verified.put(caller.credential, verified)
        if self._storage_down():
            return
        hits = self._failed_auth(caller) if status == 401 else (self._budget(verified or caller.ip_bucket),)
        try:
            for item, identifiers in hits:
                await self.limiter.hit(item, *identifiers)
        except StorageError as exc:
            self._storage_failed(exc)

    def _failed_auth(self, caller: Caller) -> tuple[tuple[RateLimitItem, tuple[str, ...]], ...]:
        by_ip = (self.failed_auth, ("failed-auth", caller.ip))
        if caller.credential is None:
            return (by_ip,)
        return by_ip, (self.failed_auth, ("failed-auth-credential", caller.credential))

    def _budget(self, bucket: Bucket) -> tuple[RateLimitItem, tuple[str, ...]]:
        return (self.reports if bucket[0] == "job" else self.requests), ("requests", *bucket)

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


def _credential_digest(scope: Scope) -> str | None:
    """The sha256 of the request's credential (not yet verified): its ``Authorization``
    header, else its dashboard session cookie; None when it presents neither."""
    cookies = None
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return hash_secret(value.decode("latin-1").strip())
        if name == b"cookie":
            cookies = value.decode("latin-1")
    if cookies is None:
        return None
    morsel = SimpleCookie()
    try:
        morsel.load(cookies)
    except CookieError:  # a malformed cookie header is no credential
        return None
    session = morsel.get(_SESSION_COOKIE)
    return hash_secret(session.value) if session is not None and session.value else None


async def _refuse(send: Callable[..., Any], wait_s: int) -> None:
    await send_error(APIError(
        429, "rate_limited",
        f"Too many requests (or failed authentications) from this client; retry after {wait_s} s.",
        headers={"Retry-After": str(wait_s)},
    ), send)
