"""An in-process cache of encoded ``GET /v1/fine_tuning/jobs`` pages, validated per request.

Clients poll the job list; rebuilding a page (query, ORM rows, JSON) costs several times
more than the rest of the request. Each API process keeps the bytes of the pages it
served, keyed by everything that selects the page (tenant, ``after``, ``limit``,
``status``, the ``metadata[...]`` filter), together with the tenant's job-change counter
(``control.db.job_versions``) read just before the page was built. A request reads the
counter again (one primary-key lookup) and reuses the bytes only if it is unchanged.

Why that is safe across processes: every transaction that writes a tenant's jobs bumps
the counter in the same commit, so a write acknowledged to a client (2xx) has changed the
counter before that client's next request reads it, whichever replica serves it; the
counter is read before the rows, so a page is never older than the counter stored with
it. Nothing else is shared between tenants: a tenant's key can only reach pages stored
under its own tenant id.

``CachedJobListMiddleware`` answers a repeated list request from this cache before FastAPI
does any work (routing, dependency solving, query parsing cost ~10x a bare endpoint): the
page is keyed by the raw query string, so it needs no parsing, and the tenant comes from
the API-key cache (``control.auth.cached_tenant_id``, the same cache and TTL the route's
authentication uses). Anything it cannot answer, or doubts, goes to the route unchanged.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from control.auth import cached_tenant_id
from control.db.job_versions import read_job_list_version

MAX_CACHE_BYTES = 32 * 1024 * 1024  # ~1,000 pages of 20 jobs


LIST_PATH = "/v1/fine_tuning/jobs"


@dataclass(frozen=True)
class PageKey:
    """Everything that selects a list page: the tenant and the raw query string.

    The raw query string holds ``after``, ``limit``, ``status`` and every
    ``metadata[...]`` filter exactly as sent (two spellings of one query are two entries,
    which costs a rebuild, never a wrong page).
    """

    tenant_id: str
    query: bytes


class JobPageCache:
    """``PageKey -> (counter, JSON bytes)``, least recently used out first, bounded in bytes."""

    def __init__(self, max_bytes: int = MAX_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[PageKey, tuple[int | None, bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: PageKey, version: int | None) -> bytes | None:
        """The page stored for ``key`` if it was built at counter ``version``, else None."""
        entry = self.peek(key)
        return entry[1] if entry is not None and entry[0] == version else None

    def peek(self, key: PageKey) -> tuple[int | None, bytes] | None:
        """``(counter, page)`` stored for ``key``, not yet validated against the database."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: PageKey, version: int | None, body: bytes) -> None:
        """Store ``body``, built from rows read after the counter was ``version``."""
        if len(body) > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._entries[key] = (version, body)
            self._bytes += len(body)
            while self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= len(evicted)

    def __len__(self) -> int:
        return len(self._entries)


class CachedJobListMiddleware:
    """Answers ``GET /v1/fine_tuning/jobs`` from ``app.state.job_pages`` when it can.

    It answers only when the Bearer key is in the key cache and a page is stored for
    (its tenant, this query string) at the tenant's current counter: one primary-key
    read in the threadpool, then the stored bytes with the route's status and headers.
    Everything else (other paths and methods, no or unknown key, dashboard cookies, no
    page, a changed counter) goes to the app, where the route authenticates, validates
    and rebuilds as usual.
    """

    def __init__(self, app: ASGIApp, *, route: Any) -> None:
        """``route``: the list's ``APIRoute``, put into the scope as the router would."""
        self.app = app
        self.route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == LIST_PATH:
            body = await self._current_page(scope)
            if body is not None:
                scope["route"] = self.route  # the latency metric's label
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-length", str(len(body)).encode()),
                    (b"content-type", b"application/json"),
                ]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)

    async def _current_page(self, scope: Scope) -> bytes | None:
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if authorization is None:
            return None
        state = scope["app"].state
        tenant_id = cached_tenant_id(state.engine.url, authorization.decode("latin-1"))
        if tenant_id is None:
            return None
        key = PageKey(tenant_id, scope["query_string"])
        stored = state.job_pages.peek(key)
        if stored is None:
            return None
        version, body = stored
        current = await run_in_threadpool(read_job_list_version, state.engine, tenant_id)
        return body if current == version else None
