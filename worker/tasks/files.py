"""Celery task ``tunefleet.validate_file``: validate an upload -> processed | error.

Delivery is at-least-once and validation is idempotent, so re-sending is always safe.
A broker can still drop a task (kombu's server-less transport loses an unacknowledged
message when its worker is SIGKILLed), so every worker re-sends the validation of files
still ``uploaded`` when it starts.

No file stays ``uploaded`` forever, and no job waits on one forever:

- a validation that raises (any exception: the validator, the store, a bug) ends the
  file ``error`` with the code ``validation_failed`` and the reason, and fails the jobs
  waiting for it with the same code;
- ``tunefleet.sweep_stale_validations`` (sent by the scheduler loop every minute) does
  the same to files still ``uploaded`` ``file_validation_deadline_s`` after their upload.

``tunefleet.delete_expired_files`` (sent by the scheduler loop every minute too) deletes
the files whose ``expires_after`` has passed, each once no unfinished job uses it, and
``tunefleet.expire_uploads`` (the same minute) ends the uploads still pending an hour after
they were created, deleting their parts.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from celery.signals import worker_ready
from sqlalchemy import select
from sqlalchemy.orm import Session

from control.artifacts import file_store
from control.db.base import utcnow
from control.db.models import File, Job
from control.db.session import session_scope
from control.files.retention import delete_expired_files
from control.files.validation import validate_file
from control.jobs.lifecycle import lock_job, transition
from control.queue import SCHEDULE, CeleryQueue
from control.settings import get_settings
from control.uploads import expire_uploads
from worker.celery_app import app

log = logging.getLogger(__name__)


@app.task(name="tunefleet.validate_file", acks_late=True, reject_on_worker_lost=True)
def validate_file_task(file_id: str) -> list[str]:
    """Validate ``file_id`` (idempotent); schedule when jobs became queued."""
    settings = get_settings()
    store = file_store(settings)
    try:
        with session_scope(settings.resolved_database_url) as session:
            queued = validate_file(session, store, file_id)
    except Exception as exc:
        log.exception("validation of file %s failed", file_id)
        reason = f"validating the file failed: {type(exc).__name__}: {exc}"[:1000]
        with session_scope(settings.resolved_database_url) as session:
            fail_validation(session, file_id, reason)
        return []
    if queued:
        CeleryQueue(settings).send(SCHEDULE)
    return queued


def fail_validation(session: Session, file_id: str, reason: str) -> list[str]:
    """End a file that could not be validated: ``error`` with ``validation_failed`` and
    ``reason``, and the jobs waiting for it failed with the same code. The caller commits.

    Returns:
        The ids of the jobs failed; nothing changes for a file already decided (or gone).
    """
    file = session.get(File, file_id, with_for_update=True)
    if file is None or file.deleted_at is not None or file.status != "uploaded":
        return []
    file.status = "error"
    file.status_details = f"validation_failed: {reason}"
    file.validation = {"ok": False, "n_errors": 1,
                       "errors": [{"code": "validation_failed", "message": reason}]}
    failed: list[str] = []
    for job_id in session.scalars(select(Job.id).where(
        Job.status == "validating_files",
        (Job.training_file == file_id) | (Job.validation_file == file_id),
    )).all():
        job = lock_job(session, job_id)
        if job is None or job.status != "validating_files":
            continue
        param = "training_file" if job.training_file == file_id else "validation_file"
        message = f"File '{file_id}' could not be validated ({reason}); upload it again."
        transition(session, job, "failed", actor="system", message=message,
                   error={"code": "validation_failed", "message": message, "param": param})
        failed.append(job.id)
    return failed


@app.task(name="tunefleet.sweep_stale_validations", acks_late=True, reject_on_worker_lost=True)
def sweep_stale_validations() -> list[str]:
    """Fail files still ``uploaded`` past ``file_validation_deadline_s`` (and their jobs)."""
    settings = get_settings()
    deadline_s = settings.file_validation_deadline_s
    cutoff = utcnow() - dt.timedelta(seconds=deadline_s)
    with session_scope(settings.resolved_database_url) as session:
        stale = session.scalars(select(File.id).where(
            File.status == "uploaded", File.deleted_at.is_(None), File.created_at < cutoff,
        ).order_by(File.created_at)).all()
        for file_id in stale:
            reason = f"not validated within {deadline_s:.0f} s of its upload"
            failed = fail_validation(session, file_id, reason)
            log.warning("file %s: %s; failed %d waiting job(s)", file_id, reason, len(failed))
    return list(stale)


@app.task(name="tunefleet.delete_expired_files", acks_late=True, reject_on_worker_lost=True)
def delete_expired_files_task() -> list[str]:
    """Delete the files past their ``expires_at`` that no unfinished job uses."""
    settings = get_settings()
    with session_scope(settings.resolved_database_url) as session:
        deleted = delete_expired_files(session, store=file_store(settings))
    if deleted:
        log.info("deleted %d expired file(s): %s", len(deleted), ", ".join(deleted))
    return deleted


@app.task(name="tunefleet.expire_uploads", acks_late=True, reject_on_worker_lost=True)
def expire_uploads_task() -> list[str]:
    """Expire the uploads still pending past their ``expires_at``; their parts are deleted."""
    settings = get_settings()
    with session_scope(settings.resolved_database_url) as session:
        expired = expire_uploads(session, store=file_store(settings))
    if expired:
        log.info("expired %d upload(s): %s", len(expired), ", ".join(expired))
    return expired


def pending_file_ids(database_url: str) -> list[str]:
    """Files uploaded but not yet validated (oldest first)."""
    with session_scope(database_url) as session:
        return list(session.scalars(
            select(File.id).where(File.status == "uploaded", File.deleted_at.is_(None))
            .order_by(File.created_at)
        ))


@worker_ready.connect
def resend_pending_validations(**_: Any) -> None:
    """On worker start: re-send validation for files a lost task left ``uploaded``."""
    settings = get_settings()
    try:
        pending = pending_file_ids(settings.resolved_database_url)
    except Exception:
        log.warning("could not look for files pending validation", exc_info=True)
        return
    for file_id in pending:
        validate_file_task.delay(file_id)
    if pending:
        log.info("re-sent validation of %d pending file(s)", len(pending))
