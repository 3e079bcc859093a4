"""The one Celery app of tunefleet, configured from ``Settings``.

Broker: Redis in production (``TUNEFLEET_BROKER_URL``); the embedded default is kombu's
server-less ``sqla+sqlite:///<data>/broker.db``. Delivery is at-least-once: tasks are
acknowledged after they finish (``acks_late``) and given back when a worker dies
(``reject_on_worker_lost``), with one task prefetched per process, so a killed worker
loses nothing. Every task is therefore idempotent by its job/file id.

Start a worker with ``tunefleet worker`` (or ``celery -A worker.celery_app worker``).
"""

from __future__ import annotations

import importlib.util

from celery import Celery

from api.settings import Settings, get_settings

# Task modules under worker/tasks/; a module listed here but not (yet) written is skipped.
TASK_MODULES = (
    "worker.tasks.files",
    "worker.tasks.jobs",
    "worker.tasks.scheduling",
    "worker.tasks.webhooks",
)


def _existing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is not None]


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
    return app


app = make_celery(get_settings())
celery = app
