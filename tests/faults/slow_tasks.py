"""The worker's own Celery app plus two test tasks, for the fault tests.

``celery -A tests.faults.slow_tasks worker`` runs the real app (``worker.celery_app``,
configured from ``TUNEFLEET_*``) with its real settings and consumer steps, and a task
that stays in flight long enough to be running (unacknowledged, ``acks_late``) while the
broker goes away.
"""

from __future__ import annotations

import time
from pathlib import Path

from worker.celery_app import app


@app.task(name="tests.faults.hold", acks_late=True)
def hold(seconds: float, marker: str) -> None:
    Path(marker).write_text("started")
    time.sleep(seconds)
    Path(marker).write_text("done")


@app.task(name="tests.faults.touch", acks_late=True)
def touch(marker: str) -> None:
    Path(marker).write_text("ran")
