"""Celery task ``tunefleet.schedule``: run one scheduling cycle now.

The API sends it after a job becomes ``queued`` (and after cancel/pause) so placement
does not wait for the loop's next tick; the scheduler lock makes it safe to run next to
``tunefleet scheduler``. Idempotent: a cycle only moves jobs whose state allows it.

Local executor only. In Kubernetes mode exactly one kind of process launches and
reconciles: the scheduler (``tunefleet scheduler``, the chart's single-replica Recreate
Deployment; ``tunefleet serve`` runs the same loop). A cycle run here would build a
second ``KubernetesExecutor`` in the worker, whose launches only this worker would
observe and whose stops the scheduler could not tell from a node drain. The task then
does nothing; the loop picks the job up within ``TUNEFLEET_SCHEDULE_INTERVAL_S``.
"""

from __future__ import annotations

import logging
import threading

from control.settings import get_settings
from worker.celery_app import app
from worker.scheduler.loop import Components, build_components, run_once

log = logging.getLogger(__name__)
_components: Components | None = None
_components_lock = threading.Lock()
NOT_RUN = {"ran": 0, "admitted": 0, "preempted": 0, "waiting": 0}


@app.task(name="tunefleet.schedule", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def schedule() -> dict[str, int]:
    """One cycle; returns counts (0s when another scheduler held the lock, or in
    Kubernetes mode, where only the scheduler process runs cycles)."""
    global _components
    settings = get_settings()
    if settings.executor == "kubernetes":
        log.debug("tunefleet.schedule: Kubernetes mode, the scheduler process places jobs")
        return dict(NOT_RUN)
    with _components_lock:  # the worker runs tasks on several threads: build them once
        if _components is None:
            _components = build_components(settings)
    result = run_once(_components)
    if not result.ran or result.plan is None:
        return dict(NOT_RUN)
    return {"ran": 1, "admitted": len(result.plan.admissions), "preempted": len(result.plan.preemptions),
            "waiting": len(result.plan.waiting)}
