"""A job's checkpoints as the control plane reads them (the routes list them in
``api.jobs.queries``)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from control.db.models import Checkpoint, Job


def latest_checkpoint(session: Session, job: Job) -> Checkpoint | None:
    """The checkpoint of ``job``'s highest step, or None before its first."""
    return session.scalar(
        select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step.desc())
    )
