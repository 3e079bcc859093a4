"""Celery task ``tunefleet.run_local_job``: the local executor's supervising task.

Only the registration lives here; what the task does -- supervise one run attempt's
trainer and record how it ended -- is ``worker.executors.local.supervisor``.
"""

from __future__ import annotations

from worker.celery_app import app
from worker.executors.local.supervisor import supervise_attempt


# acks_late with reject_on_worker_lost: a worker killed mid-run gives the task back (Redis
# redelivers it after the visibility timeout); the body is idempotent by job and attempt.
@app.task(name="tunefleet.run_local_job", acks_late=True, reject_on_worker_lost=True)
def run_local_job(job_id: str, attempt: int | None = None) -> str:
    """Supervise the trainer of ``job_id``'s run ``attempt`` until it ends; returns the job's
    final status (``worker.executors.local.supervisor.supervise_attempt``)."""
    return supervise_attempt(job_id, attempt)
