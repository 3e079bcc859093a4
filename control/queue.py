"""Sending Celery tasks by name, so the API never imports worker code.

``CeleryQueue`` holds a producer-only Celery app on the configured broker. Sending is
best effort where the system heals itself (the scheduler also runs periodically and
re-validates files left ``uploaded``): a failure is logged and reported as ``False``,
never turned into a 5xx for the user.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from control.settings import Settings

log = logging.getLogger(__name__)

VALIDATE_FILE = "tunefleet.validate_file"
SCHEDULE = "tunefleet.schedule"
RUN_LOCAL_JOB = "tunefleet.run_local_job"
DELIVER_WEBHOOK = "tunefleet.deliver_webhook"


class TaskQueue(Protocol):
    def send(self, name: str, *args: Any, **kwargs: Any) -> bool:
        """Enqueue task ``name``; True when the broker accepted it."""


class CeleryQueue:
    """Sends tasks to the Celery broker of ``settings`` by name."""

    def __init__(self, settings: Settings) -> None:
        from celery import Celery

        self._app = Celery("tunefleet-api", broker=settings.resolved_broker_url)
        self._app.conf.update(
            broker_connection_timeout=3,
            broker_connection_retry_on_startup=False,
            task_ignore_result=True,
        )

    def send(self, name: str, *args: Any, **kwargs: Any) -> bool:
        try:
            self._app.send_task(
                name, args=args, kwargs=kwargs, retry=True,
                retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.5},
            )
            return True
        except Exception:
            log.warning("could not send task %s%r", name, args, exc_info=True)
            return False


class RecordingQueue:
    """Keeps sent tasks in a list (tests and tools that run tasks themselves)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def send(self, name: str, *args: Any, **kwargs: Any) -> bool:
        self.sent.append((name, args, kwargs))
        return True
