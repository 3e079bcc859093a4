"""Prometheus metrics of the control plane (``/metrics``).

``install(app)`` adds the request-latency middleware and the ``/metrics`` route; the
state metrics (jobs, queues, GPUs, running trainers, webhook outbox) are read from the
database at scrape time by ``collectors.DatabaseCollector``, so every API replica
reports the same truth and nothing has to be kept in sync in memory.
"""

from __future__ import annotations

from fastapi import FastAPI


def install(app: FastAPI) -> None:
    """Add the latency middleware and ``GET /metrics`` to ``app``."""
    from api.observability.metrics import RequestLatencyMiddleware, router

    app.add_middleware(RequestLatencyMiddleware)
    app.include_router(router)
