"""``/metrics`` and ``/healthz`` of a process that is not the API (Celery worker, scheduler).

The worker increments counters (webhook delivery failures) and the scheduler may export
the database gauges; neither runs an HTTP server of its own, so ``serve_metrics`` starts a
small threaded WSGI server in a daemon thread on ``TUNEFLEET_METRICS_PORT``:

- ``GET /metrics``: the given registry in Prometheus text format, behind the same bearer
  token as the API's ``/metrics`` when ``TUNEFLEET_METRICS_TOKEN`` is set;
- ``GET /healthz``: 200 while ``liveness()`` returns None, else 503 with its reason (the
  pod's liveness probe: a stopped consumer or a stuck loop gets the container restarted).

``Heartbeat`` is the liveness record such a process touches from its own main loop.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

Liveness = Callable[[], "str | None"]


class Heartbeat:
    """When a loop last made progress; ``stale_reason`` says why it counts as stuck."""

    def __init__(self, what: str, stale_after_s: float) -> None:
        self.what = what
        self.stale_after_s = stale_after_s
        self._at: float | None = None

    def touch(self) -> None:
        self._at = time.monotonic()

    def stale_reason(self) -> str | None:
        if self._at is None:
            return f"{self.what} has not started yet"
        age = time.monotonic() - self._at
        if age > self.stale_after_s:
            return f"{self.what} last made progress {age:.0f} s ago (limit {self.stale_after_s:.0f} s)"
        return None


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not worth a log line each."""


def metrics_app(registry: CollectorRegistry, liveness: Liveness, token: str | None) -> Callable[..., Iterable[bytes]]:
    """The WSGI application behind ``serve_metrics`` (exposed for tests)."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/healthz":
            reason = liveness()
            status = "200 OK" if reason is None else "503 Service Unavailable"
            body = (reason or "ok").encode() + b"\n"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            return [body]
        if path != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: try /metrics or /healthz\n"]
        if token:
            given = environ.get("HTTP_AUTHORIZATION", "").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(given.encode(), token.encode()):
                start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8")])
                return [b"GET /metrics needs 'Authorization: Bearer <metrics token>'\n"]
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
        return [generate_latest(registry)]

    return app


def serve_metrics(port: int, registry: CollectorRegistry, liveness: Liveness, *,
                  token: str | None = None, host: str = "0.0.0.0") -> WSGIServer:
    """Serve ``/metrics`` and ``/healthz`` on ``host:port`` from a daemon thread."""
    server = make_server(host, port, metrics_app(registry, liveness, token),
                         server_class=_ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    return server
