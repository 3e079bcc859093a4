"""The API's request latency and the ``/metrics`` route.

``/metrics`` serves ``control.observability.registry.process_registry`` (every process's
counters in multiprocess mode). The database gauges (``control.observability.collectors``) are added when
``TUNEFLEET_METRICS_DATABASE_GAUGES`` is ``api`` (one API replica); with ``scheduler`` the
scheduler process exports them instead, once for the whole deployment, so summing over
every scraped replica counts each job once.

The latency histogram is labelled by the route TEMPLATE (``/v1/fine_tuning/jobs/{job_id}``),
never the raw path, so ids do not explode the label cardinality.
"""

from __future__ import annotations

import os
import secrets
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Histogram,
    generate_latest,
)
from sqlalchemy.orm import Session, sessionmaker
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import SessionFactoryDep, SettingsDep
from control.errors import APIError
from control.observability.collectors import DatabaseCollector
from control.observability.registry import process_registry
from control.settings import Settings

REQUEST_LATENCY = Histogram(
    "tunefleet_http_request_duration_seconds",
    "API request latency by method, route template and status code",
    ["method", "route", "status"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)


def _route_template(app: ASGIApp, scope: Scope) -> str:
    route = scope.get("route")
    if route is not None and getattr(route, "path", None):
        return route.path
    router = getattr(app, "router", None)
    for candidate in getattr(router, "routes", ()):
        match, _ = candidate.matches(scope)
        if match == Match.FULL:
            return getattr(candidate, "path", "unmatched")
    return "unmatched"


class RequestLatencyMiddleware:
    """Observes every HTTP request's latency, labelled by method, route template, status.

    A plain ASGI middleware, not ``BaseHTTPMiddleware``: the latter runs each request
    through an extra task and memory streams, which halved the API's throughput.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            # The router has written the matched route into the (shared) scope by now.
            route = _route_template(scope["app"], scope) if "app" in scope else "unmatched"
            if route != "/metrics":
                REQUEST_LATENCY.labels(scope["method"], route, str(status)).observe(
                    time.perf_counter() - start)


router = APIRouter(include_in_schema=False)



def _registry(settings: Settings, factory: sessionmaker[Session], *, job_series: bool) -> CollectorRegistry:
    registry = process_registry()
    if settings.metrics_database_gauges == "api":
        registry.register(DatabaseCollector(lambda: factory, job_series=job_series))
    return registry



@router.get("/metrics", response_model=None)
def metrics(request: Request, settings: SettingsDep, factory: SessionFactoryDep) -> Response:
    """Prometheus text format. With ``TUNEFLEET_METRICS_TOKEN`` set, a matching bearer
    token is required; without one (a developer's machine) the per-job gauges, whose labels
    are job ids, are left out."""
    token = os.environ.get("TUNEFLEET_METRICS_TOKEN")
    if token:
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), token.encode()):
            raise APIError(401, "invalid_metrics_token", "GET /metrics needs 'Authorization: Bearer <metrics token>'.")
    registry = _registry(settings, factory, job_series=bool(token))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
