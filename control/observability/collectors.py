"""Metrics computed from the database at scrape time.

Each scrape runs a handful of aggregate queries (jobs by status/pool, queued jobs per
pool with the oldest wait, GPUs held by running jobs, the newest metric row of each
running job: per job, and per pool the mean tokens/s and MFU of its running jobs; webhook
outbox counts). GPU capacity per pool comes from a provider the application registers
(``set_pool_capacity_provider``), because pool configuration is owned by the scheduler;
without one, only allocated GPUs are reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from control.db.base import utcnow
from control.db.models import Job, JobMetric

log = logging.getLogger(__name__)

NO_POOL = "none"
PoolCapacity = Callable[[], dict[str, int]]
_capacity_provider: PoolCapacity | None = None


def set_pool_capacity_provider(provider: PoolCapacity | None) -> None:
    """Register ``provider() -> {pool name: total GPUs}`` for the GPU free/total gauges."""
    global _capacity_provider
    _capacity_provider = provider


def _pool_of(job_pool: str | None, placement: dict[str, Any] | None) -> str:
    return job_pool or (placement or {}).get("pool") or NO_POOL


class DatabaseCollector(Collector):
    """Yields the state gauges from one short read-only session per scrape."""

    def __init__(self, session_factory: Callable[[], sessionmaker[Session]], *,
                 enabled: Callable[[], bool] | None = None, job_series: bool = True) -> None:
        """``enabled``: asked at every scrape; False yields nothing (a standby scheduler
        replica leaves the gauges to the active one). ``job_series``: whether the running
        jobs' gauges (labelled with their ids) are yielded: only where a token guards the
        scrape, since job ids belong to their tenants."""
        self._session_factory = session_factory
        self._enabled = enabled
        self._job_series = job_series

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self._enabled is not None and not self._enabled():
            return
        try:
            with self._session_factory()() as session:
                yield from self._collect(session)
        except Exception:
            log.exception("metrics: database collection failed")
            up = GaugeMetricFamily("tunefleet_metrics_database_up", "1 when the DB metrics were collected")
            up.add_metric([], 0)
            yield up
            return
        up = GaugeMetricFamily("tunefleet_metrics_database_up", "1 when the DB metrics were collected")
        up.add_metric([], 1)
        yield up

    def _collect(self, session: Session) -> Iterator[GaugeMetricFamily]:
        now = utcnow()
        jobs = GaugeMetricFamily("tunefleet_jobs", "Jobs by status and node pool", labels=["status", "pool"])
        by_status_pool: dict[tuple[str, str], int] = {}
        # Placed jobs are counted by SQL; PostgreSQL cannot GROUP BY a json column, so the
        # few jobs never placed (queued, or failed before placement) are read row by row.
        placed = session.execute(select(Job.status, Job.pool, func.count())
                                 .where(Job.pool.is_not(None)).group_by(Job.status, Job.pool))
        for status, pool, count in placed:
            by_status_pool[(status, pool)] = by_status_pool.get((status, pool), 0) + count
        for status, placement in session.execute(select(Job.status, Job.placement).where(Job.pool.is_(None))):
            key = (status, _pool_of(None, placement))
            by_status_pool[key] = by_status_pool.get(key, 0) + 1
        for (status, pool), count in sorted(by_status_pool.items()):
            jobs.add_metric([status, pool], count)
        yield jobs

        # Queue: a queued job has no pool yet; it counts for the pool it asked for, or "any".
        depth = GaugeMetricFamily("tunefleet_queue_depth", "Queued jobs per requested pool", labels=["pool"])
        oldest = GaugeMetricFamily("tunefleet_queue_oldest_wait_seconds",
                                   "Age of the oldest queued job per requested pool", labels=["pool"])
        queued: dict[str, list[float]] = {}
        for placement, created_at in session.execute(
            select(Job.placement, Job.created_at).where(Job.status == "queued")
        ):
            pool = (placement or {}).get("pool") or "any"
            queued.setdefault(pool, []).append((now - created_at).total_seconds())
        # Every known pool (and "any") gets a sample, 0 when empty: "no data" on a
        # dashboard would read as "not scraped".
        capacity = _safe_capacity()
        for pool in sorted(set(queued) | set(capacity) | {"any"}):
            waits = queued.get(pool, [])
            depth.add_metric([pool], len(waits))
            oldest.add_metric([pool], max(waits, default=0.0))
        yield depth
        yield oldest

        allocated = GaugeMetricFamily("tunefleet_gpus_allocated", "GPUs held by running jobs", labels=["pool"])
        held: dict[str, int] = {}
        for pool, gpus in session.execute(
            select(Job.pool, func.coalesce(func.sum(Job.gpus), 0)).where(Job.status == "running").group_by(Job.pool)
        ):
            held[pool or NO_POOL] = int(gpus)
        for pool in sorted(set(held) | set(capacity)):
            allocated.add_metric([pool], held.get(pool, 0))
        yield allocated
        if capacity:
            total = GaugeMetricFamily("tunefleet_gpus_total", "GPUs of each pool", labels=["pool"])
            free = GaugeMetricFamily("tunefleet_gpus_free", "GPUs not held by running jobs", labels=["pool"])
            for pool, gpus in sorted(capacity.items()):
                total.add_metric([pool], gpus)
                free.add_metric([pool], max(gpus - held.get(pool, 0), 0))
            yield total
            yield free

        yield from self._running_jobs(session)
        yield from self._webhooks(session)

    def _running_jobs(self, session: Session) -> Iterator[GaugeMetricFamily]:
        """The newest metric row of each running job: per job (only with ``job_series``)
        and, with no job named, each pool's mean throughput and MFU over its running jobs."""
        latest = (
            select(JobMetric.job_id, func.max(JobMetric.step).label("step"))
            .join(Job, Job.id == JobMetric.job_id)
            .where(Job.status == "running")
            .group_by(JobMetric.job_id)
            .subquery()
        )
        rows = session.execute(
            select(JobMetric, Job.pool)
            .join(latest, (JobMetric.job_id == latest.c.job_id) & (JobMetric.step == latest.c.step))
            .join(Job, Job.id == JobMetric.job_id)
        ).all()
        if self._job_series:
            yield from _job_gauges(rows)
        yield from _pool_throughput(rows)

    def _webhooks(self, session: Session) -> Iterator[GaugeMetricFamily]:
        try:
            from control.webhooks.models import WebhookDelivery
        except ImportError:
            return
        deliveries = GaugeMetricFamily("tunefleet_webhook_deliveries", "Webhook deliveries by status",
                                       labels=["status"])
        counts = dict(session.execute(
            select(WebhookDelivery.status, func.count()).group_by(WebhookDelivery.status)).tuples().all())
        for status in ("pending", "succeeded", "failed"):
            deliveries.add_metric([status], counts.get(status, 0))
        yield deliveries


def _safe_capacity() -> dict[str, int]:
    if _capacity_provider is None:
        return {}
    try:
        return dict(_capacity_provider())
    except Exception:
        log.exception("metrics: pool capacity provider failed")
        return {}


def _job_gauges(rows: Sequence[Any]) -> Iterator[GaugeMetricFamily]:
    labels = ["job_id", "pool"]
    speed = GaugeMetricFamily("tunefleet_job_tokens_per_second", "Trainer throughput (latest step)", labels=labels)
    mfu = GaugeMetricFamily("tunefleet_job_mfu", "Model FLOP utilisation, a fraction (latest step)", labels=labels)
    loss = GaugeMetricFamily("tunefleet_job_train_loss", "Training loss (latest step)", labels=labels)
    step = GaugeMetricFamily("tunefleet_job_step", "Latest optimizer step", labels=labels)
    total = GaugeMetricFamily("tunefleet_job_total_steps", "Planned optimizer steps", labels=labels)
    for metric, pool in rows:
        values = [metric.job_id, pool or NO_POOL]
        if metric.tokens_per_s is not None:
            speed.add_metric(values, metric.tokens_per_s)
        if metric.mfu is not None:
            mfu.add_metric(values, metric.mfu)
        if metric.train_loss is not None:
            loss.add_metric(values, metric.train_loss)
        step.add_metric(values, metric.step)
        if metric.total_steps is not None:
            total.add_metric(values, metric.total_steps)
    yield from (speed, mfu, loss, step, total)


def _pool_throughput(rows: Sequence[Any]) -> Iterator[GaugeMetricFamily]:
    """Per pool, the mean over its running jobs of their latest step's tokens/s and MFU.
    A pool gets a sample only where a running job reported one: no sample reads as "no
    data", where a 0 would read as an idle gang."""
    speeds: dict[str, list[float]] = {}
    mfus: dict[str, list[float]] = {}
    for metric, pool in rows:
        if metric.tokens_per_s is not None:
            speeds.setdefault(pool or NO_POOL, []).append(metric.tokens_per_s)
        if metric.mfu is not None:
            mfus.setdefault(pool or NO_POOL, []).append(metric.mfu)
    speed = GaugeMetricFamily("tunefleet_pool_tokens_per_second",
                              "Mean trainer throughput of the pool's running jobs (latest step)", labels=["pool"])
    mfu = GaugeMetricFamily("tunefleet_pool_mfu",
                            "Mean model FLOP utilisation, a fraction, of the pool's running jobs (latest step)",
                            labels=["pool"])
    for family, values in ((speed, speeds), (mfu, mfus)):
        for pool, samples in sorted(values.items()):
            family.add_metric([pool], sum(samples) / len(samples))
    yield from (speed, mfu)
