"""Prometheus endpoints of the Celery worker and the scheduler (``TUNEFLEET_METRICS_PORT``).

Both processes serve ``/metrics`` and ``/healthz`` from a thread of their own
(``control.observability.exporter``); the chart scrapes them with a PodMonitor and probes
``/healthz``:

- worker: its counters (webhook delivery failures counted by the delivery task). The
  default ``threads`` pool runs tasks in this process; a ``prefork`` pool needs
  ``PROMETHEUS_MULTIPROC_DIR`` so the children's counters are aggregated. Alive while the
  consumer's heartbeat timer fires (``WORKER_HEARTBEAT``, touched by ``worker.celery_app``).
- scheduler: the database gauges when ``TUNEFLEET_METRICS_DATABASE_GAUGES=scheduler``,
  from the one replica that holds the exporter lease (``GAUGE_EXPORTER``; the loop takes
  and keeps it), so they are exported once however many API and scheduler replicas are
  scraped;
  and ``tunefleet_scheduler_last_cycle_timestamp_seconds``. Alive while its
  loop keeps cycling (``SCHEDULER_HEARTBEAT``, touched by ``worker.scheduler.loop``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily

from control.observability.exporter import Heartbeat, serve_metrics
from control.settings import Settings

log = logging.getLogger(__name__)

# The consumer beats every 10 s (control.worker_heartbeat.BEAT_INTERVAL_S); three missed beats
# and more mean it stopped consuming.
WORKER_HEARTBEAT = Heartbeat("the worker's consumer", stale_after_s=45.0)
SCHEDULER_HEARTBEAT = Heartbeat("the scheduling loop", stale_after_s=120.0)


class _LastCycle:
    """``tunefleet_scheduler_last_cycle_timestamp_seconds``: alerts on a stalled loop."""

    def __init__(self) -> None:
        self.at: float | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("tunefleet_scheduler_last_cycle_timestamp_seconds",
                                   "Unix time the scheduling loop last finished a cycle")
        if self.at is not None:
            family.add_metric([], self.at)
        yield family


LAST_CYCLE = _LastCycle()


# Set while this scheduler process holds the exporter lease
# (``worker.scheduler.lock.make_lock(..., exporter=True)``): only then does it export the
# database gauges.
GAUGE_EXPORTER = threading.Event()


def scheduler_cycled(*, exporting: bool | None = None) -> None:
    """Called by the scheduling loop after every cycle, whatever its outcome; ``exporting``:
    whether it holds the exporter lease now (None: it does not take part)."""
    SCHEDULER_HEARTBEAT.touch()
    LAST_CYCLE.at = time.time()
    if exporting is not None:
        (GAUGE_EXPORTER.set if exporting else GAUGE_EXPORTER.clear)()


def _token(settings: Settings) -> str | None:
    return settings.metrics_token.get_secret_value() if settings.metrics_token else None


def start_worker_metrics(settings: Settings) -> None:
    """Serve the worker's ``/metrics`` and ``/healthz`` when ``metrics_port`` is set."""
    if not settings.metrics_port:
        return
    from control.observability.registry import process_registry

    serve_metrics(settings.metrics_port, process_registry(), WORKER_HEARTBEAT.stale_reason,
                  token=_token(settings))
    log.info("worker metrics on :%d/metrics", settings.metrics_port)


def start_scheduler_metrics(settings: Settings) -> None:
    """Serve the scheduler's ``/metrics`` (with the database gauges when it exports them)."""
    if not settings.metrics_port:
        return
    from control.db.session import session_factory
    from control.observability.collectors import DatabaseCollector, set_pool_capacity_provider
    from control.observability.registry import process_registry
    from scheduling.pools import load_pools

    # A slow configured interval must not read as a stuck loop.
    SCHEDULER_HEARTBEAT.stale_after_s = max(120.0, 4 * settings.schedule_interval_s)
    registry = process_registry()
    registry.register(LAST_CYCLE)
    if settings.metrics_database_gauges == "scheduler":
        pools = load_pools(settings.node_pools_file)
        totals = {p.name: p.gpus_per_node * p.nodes for p in pools}
        set_pool_capacity_provider(lambda: totals)
        factory = session_factory(settings.resolved_database_url)
        registry.register(DatabaseCollector(lambda: factory, enabled=GAUGE_EXPORTER.is_set,
                                            job_series=_token(settings) is not None))
    serve_metrics(settings.metrics_port, registry, SCHEDULER_HEARTBEAT.stale_reason, token=_token(settings))
    log.info("scheduler metrics on :%d/metrics (database gauges: %s)", settings.metrics_port,
             settings.metrics_database_gauges)
