"""How long a file is kept: until its ``expires_at``, and past it while a job that has not
finished still trains on it (its trainer reads the file when it starts, restarts or
resumes)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from control.artifacts import ArtifactStore
from control.db.base import utcnow
from control.db.models import TERMINAL_STATUSES, File, Job


def used_by_unfinished_job(file_id: Any):
    """A SQL condition: a job that has not finished trains on, or validates with, the file
    (an id, or ``File.id`` in a query over files)."""
    return exists().where(
        (Job.training_file == file_id) | (Job.validation_file == file_id),
        Job.status.not_in(TERMINAL_STATUSES),
    )


def delete_expired_files(
    session: Session, *, store: ArtifactStore, now: dt.datetime | None = None, limit: int = 500
) -> list[str]:
    """Delete up to ``limit`` files past their ``expires_at`` (row marked deleted, content
    removed); returns their ids, oldest expiry first.

    A file a queued, running or paused job still uses is kept until that job ends: its
    trainer reads the file when it starts, and again when it restarts or resumes.
    """
    deleted = session.scalars(
        select(File).where(
            File.deleted_at.is_(None), File.expires_at.is_not(None), File.expires_at <= (now or utcnow()),
            ~used_by_unfinished_job(File.id),
        ).order_by(File.expires_at).limit(limit)
    ).all()
    gone = [(row.id, row.location) for row in deleted]
    for row in deleted:
        row.deleted_at = utcnow()
    # The rows first: a crash between the two leaves an unreferenced blob, never a
    # listed file without content.
    session.commit()
    for _, location in gone:
        store.delete(location)
    return [file_id for file_id, _ in gone]
