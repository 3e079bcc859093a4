"""Celery task ``tunefleet.validate_file``: validate an upload -> processed | error.

Delivery is at-least-once and validation is idempotent, so re-sending is always safe.
A broker can still drop a task (kombu's server-less transport loses an unacknowledged
message when its worker is SIGKILLed), so every worker re-sends the validation of files
still ``uploaded`` when it starts.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import worker_ready
from sqlalchemy import select

from api.artifacts import file_store
from api.db.models import File
from api.db.session import session_scope
from api.queue import SCHEDULE, CeleryQueue
from api.settings import get_settings
from api.validation import validate_file
from worker.celery_app import app

log = logging.getLogger(__name__)


@app.task(name="tunefleet.validate_file", acks_late=True, reject_on_worker_lost=True)
def validate_file_task(file_id: str) -> list[str]:
    """Validate ``file_id`` (idempotent); schedule when jobs became queued."""
    settings = get_settings()
    store = file_store(settings)
    with session_scope(settings.resolved_database_url) as session:
        queued = validate_file(session, store, file_id)
    if queued:
        CeleryQueue(settings).send(SCHEDULE)
    return queued


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
