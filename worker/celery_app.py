"""The one Celery app of tunefleet, configured from ``Settings``.

Broker: Redis in production (``TUNEFLEET_BROKER_URL``); the embedded default is kombu's
server-less ``sqla+sqlite:///<data>/broker.db``. Delivery is at-least-once: tasks are
acknowledged after they finish (``acks_late``) and given back when a worker dies
(``reject_on_worker_lost``), with one task prefetched per process, so a killed worker
loses nothing. Every task is therefore idempotent by its job/file id.

Start a worker with ``tunefleet worker`` (or ``celery -A worker.celery_app worker``).
While its consumer runs, the worker writes a heartbeat that ``/readyz`` checks
(``control.worker_heartbeat``).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from celery import Celery, bootsteps
from celery.worker.consumer.tasks import Tasks

from control import worker_heartbeat
from control.settings import Settings, get_settings

log = logging.getLogger(__name__)

# Task modules under worker/tasks/; a module listed here but not (yet) written is skipped.
TASK_MODULES = (
    "worker.tasks.files",
    "worker.tasks.jobs",
    "worker.tasks.scheduling",
    "worker.tasks.webhooks",
    "worker.tasks.exports",
    "worker.tasks.hub_models",
)


def _existing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is not None]


class WorkerHeartbeat(bootsteps.StartStopStep):
    """A consumer step: beats on the consumer's timer, so beats stop when consuming does
    (a lost broker connection restarts the consumer; an unrecoverable error ends it)."""

    requires = (Tasks,)

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        super().__init__(consumer, **kwargs)
        self.timer_entry: Any = None

    def start(self, consumer: Any) -> None:
        settings = consumer.app.tunefleet_settings
        self._beat(settings)
        self.timer_entry = consumer.timer.call_repeatedly(
            worker_heartbeat.BEAT_INTERVAL_S, self._beat, (settings,), priority=10,
        )

    def stop(self, consumer: Any) -> None:
        if self.timer_entry is not None:
            self.timer_entry.cancel()
            self.timer_entry = None

    shutdown = stop

    @staticmethod
    def _beat(settings: Settings) -> None:
        from worker.metrics import WORKER_HEARTBEAT

        WORKER_HEARTBEAT.touch()  # the timer fired: the consumer runs (the pod's liveness)
        try:
            worker_heartbeat.beat(settings)
        except Exception:  # a missed beat shows in /readyz; never stop consuming for it
            log.warning("could not write the worker heartbeat", exc_info=True)


def make_celery(settings: Settings) -> Celery:
    """A Celery app for ``settings`` (tests build their own with other settings)."""
    app = Celery("tunefleet", broker=settings.resolved_broker_url, include=_existing(TASK_MODULES))
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        timezone="UTC",
    )
    if settings.resolved_broker_url.startswith(("redis://", "rediss://")):
        # A task not acknowledged within this time is delivered again: longer than any
        # task runs (run_local_job supervises a trainer for hours).
        app.conf.broker_transport_options = {"visibility_timeout": 24 * 3600}
    # Tasks keep running through a broker reconnect (a supervised trainer is not killed
    # by a Redis restart) and acknowledge when done. Celery's default today, set because
    # Celery announces it will change.
    app.conf.worker_cancel_long_running_tasks_on_connection_loss = False
    app.tunefleet_settings = settings  # type: ignore[attr-defined]  # read by WorkerHeartbeat
    app.steps["consumer"].add(WorkerHeartbeat)
    return app


app = make_celery(get_settings())
celery = app
