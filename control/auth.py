"""API-key authentication and tenant/key administration (used by routes and the CLI).

Every API request authenticates, so the key lookup sits on the hot path. A short-lived
in-process cache (``KeyCache``) maps ``sha256(key)`` to a detached snapshot of the key row
and its tenant, so a repeated key costs no database round trip: ``authenticate`` merges
the snapshot into the request's session without SQL (``Session.merge(load=False)``), and
routes receive an ordinary persistent ``ApiKey`` whose ``tenant`` is loaded.

Revocation: ``revoke_api_key`` drops the key from this process's cache at once (and again
after the revoking transaction commits). Another process (a second API replica, the CLI)
cannot reach this cache, so there a revoked key keeps working for at most
``KEY_CACHE_TTL_S`` seconds. Only live keys are cached; unknown or revoked keys always
go to the database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import URL, event, select
from sqlalchemy.orm import Session, joinedload, make_transient_to_detached

from control.db.base import to_unix, utcnow
from control.db.models import ApiKey, Tenant
from control.errors import APIError
from control.ids import hash_secret, key_prefix, new_api_key, new_id

KEY_CACHE_TTL_S = 5.0
KEY_CACHE_MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class _CachedKey:
    key: ApiKey  # detached snapshot with its tenant; never handed out, only merged
    expires_at: float


class KeyCache:
    """``(database URL, key hash) -> key snapshot``, each entry valid for ``ttl_s`` seconds.

    Entries are keyed by database too, so two apps in one process (tests, tools) never
    share keys. ``invalidate`` bumps a generation counter: a lookup that started before an
    invalidation does not store what it read, so a revocation cannot be undone by a
    concurrent request that read the row just before it.
    """

    def __init__(self, ttl_s: float = KEY_CACHE_TTL_S, max_entries: int = KEY_CACHE_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: dict[tuple[URL, str], _CachedKey] = {}
        self._lock = threading.Lock()
        self.generation = 0

    def get(self, database: URL, key_hash: str) -> ApiKey | None:
        entry = self._entries.get((database, key_hash))
        if entry is None:
            return None
        if entry.expires_at <= self._clock():
            with self._lock:
                if self._entries.get((database, key_hash)) is entry:
                    del self._entries[(database, key_hash)]
            return None
        return entry.key

    def put(self, database: URL, key: ApiKey, *, generation: int) -> None:
        """Store a snapshot of the live ``key`` (its tenant loaded) read at ``generation``."""
        if self.ttl_s <= 0:
            return
        snapshot = _detached_copy(key)
        with self._lock:
            if generation != self.generation:
                return  # a key was revoked while we read: what we read may be stale
            if len(self._entries) >= self.max_entries:
                self._entries.clear()  # crude but bounded; refills at one query per key
            self._entries[(database, key.key_hash)] = _CachedKey(
                snapshot, self._clock() + self.ttl_s)

    def invalidate(self, key_hash: str) -> None:
        """Forget ``key_hash`` (in every database) and void lookups in flight."""
        with self._lock:
            self.generation += 1
            for entry in [e for e in self._entries if e[1] == key_hash]:
                del self._entries[entry]

    def clear(self) -> None:
        with self._lock:
            self.generation += 1
            self._entries.clear()


def _detached_copy(key: ApiKey) -> ApiKey:
    """A new detached ``ApiKey`` + ``Tenant`` with the same column values as ``key``."""
    tenant = key.tenant
    tenant_copy = Tenant(id=tenant.id, name=tenant.name, is_admin=tenant.is_admin,
                         created_at=tenant.created_at)
    make_transient_to_detached(tenant_copy)
    key_copy = ApiKey(
        id=key.id, tenant_id=key.tenant_id, name=key.name, prefix=key.prefix,
        key_hash=key.key_hash, is_admin=key.is_admin, created_at=key.created_at,
        last_used_at=key.last_used_at, revoked_at=key.revoked_at,
    )
    make_transient_to_detached(key_copy)
    # Attach the tenant after both have an identity, so no change history is recorded
    # (merge(load=False) refuses objects with pending changes).
    key_copy.__dict__["tenant"] = tenant_copy
    return key_copy


key_cache = KeyCache()


def authenticate_cached(session: Session, authorization: str) -> ApiKey | None:
    """The key of a well-formed Bearer header if ``key_cache`` holds it, else None.

    Does no I/O (safe in the event loop): the cached snapshot is merged into ``session``
    without a query. None means "ask ``authenticate``", not "invalid".
    """
    token = _bearer_token(authorization)
    if token is None:
        return None
    cached = key_cache.get(session.get_bind().url, hash_secret(token))
    if cached is None:
        return None
    return session.merge(cached, load=False)


def cached_tenant_id(database: URL, authorization: str) -> str | None:
    """The tenant id of a Bearer key that ``key_cache`` holds (live, within its TTL), else None.

    For fast paths that need only the tenant (``api.jobs.pages``); no I/O, no session.
    None means "authenticate the usual way", not "invalid".
    """
    token = _bearer_token(authorization)
    if token is None:
        return None
    cached = key_cache.get(database, hash_secret(token))
    return None if cached is None else cached.tenant_id


def _bearer_token(authorization: str) -> str | None:
    """The key of ``Bearer <key>`` if it is shaped like one of our keys, else None."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or key_prefix(token) is None:
        return None
    return token


def authenticate(session: Session, authorization: str | None) -> ApiKey:
    """The live key named by an ``Authorization: Bearer`` header, else a 401.

    Served from ``key_cache`` when the key was seen in the last ``KEY_CACHE_TTL_S``
    seconds; otherwise one query loads the key with its tenant.
    """
    if not authorization:
        raise APIError(
            401,
            "missing_api_key",
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            headers={"WWW-Authenticate": "Bearer"},
        )
    token = _bearer_token(authorization)
    if token is None:
        raise _invalid_key()
    key_hash = hash_secret(token)
    database = session.get_bind().url
    cached = key_cache.get(database, key_hash)
    if cached is not None:
        return session.merge(cached, load=False)
    generation = key_cache.generation
    # One round trip: the key and its tenant (every authenticated route needs both).
    key = session.scalar(
        select(ApiKey).options(joinedload(ApiKey.tenant)).where(ApiKey.key_hash == key_hash)
    )
    if key is None or key.revoked_at is not None:
        raise _invalid_key()
    key_cache.put(database, key, generation=generation)
    return key


def _invalid_key() -> APIError:
    return APIError(
        401, "invalid_api_key", "Incorrect API key provided.", headers={"WWW-Authenticate": "Bearer"}
    )


def create_tenant(session: Session, name: str, *, is_admin: bool = False) -> Tenant:
    """A new tenant (``org-…``); names are unique."""
    if session.scalar(select(Tenant).where(Tenant.name == name)) is not None:
        raise APIError(409, "tenant_exists", f"A tenant named '{name}' already exists.", param="name")
    tenant = Tenant(id=new_id("org"), name=name, is_admin=is_admin)
    session.add(tenant)
    session.flush()
    return tenant


def create_api_key(
    session: Session, tenant: Tenant, *, is_admin: bool = False, name: str | None = None,
    raw_key: str | None = None,
) -> tuple[ApiKey, str]:
    """A new key for ``tenant``; returns the row and the raw key (shown once, never stored).

    ``raw_key`` lets an operator install a key of their own (``TUNEFLEET_ADMIN_API_KEY``).
    """
    if raw_key is None:
        raw_key, prefix = new_api_key()
    else:
        prefix = key_prefix(raw_key) or raw_key[:8]
    key = ApiKey(
        id=new_id("key"), tenant=tenant, prefix=prefix, key_hash=hash_secret(raw_key),
        is_admin=is_admin, name=name,
    )
    session.add(key)
    session.flush()
    return key, raw_key


def tenant_object(tenant: Tenant) -> dict[str, Any]:
    """A tenant as ``/v1/admin`` (and ``tunefleet admin ... --json``) shows it."""
    return {"id": tenant.id, "object": "organization", "name": tenant.name, "is_admin": tenant.is_admin,
            "created_at": to_unix(tenant.created_at)}


def key_object(key: ApiKey) -> dict[str, Any]:
    """An API key as ``/v1/admin`` (and ``tunefleet admin ... --json``) shows it; never the key itself."""
    return {"id": key.id, "object": "api_key", "prefix": key.prefix, "name": key.name,
            "tenant_id": key.tenant_id, "is_admin": key.is_admin, "created_at": to_unix(key.created_at),
            "revoked_at": to_unix(key.revoked_at)}


def revoke_api_key(session: Session, key: ApiKey) -> None:
    """Mark ``key`` revoked; this process stops accepting it now, others within the TTL."""
    key.revoked_at = utcnow()
    session.flush()
    key_hash = key.key_hash
    key_cache.invalidate(key_hash)
    # A request may have re-read the still-uncommitted row between the flush and the
    # commit; forget the key once more when the revocation is visible to everyone.
    event.listen(session, "after_commit", lambda _s: key_cache.invalidate(key_hash), once=True)
