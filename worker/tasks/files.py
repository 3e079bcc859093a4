"""Celery task ``tunefleet.validate_file``: validate an upload -> processed | error."""

from __future__ import annotations

from api.artifacts import file_store
from api.db.session import session_scope
from api.queue import SCHEDULE, CeleryQueue
from api.settings import get_settings
from api.validation import validate_file
from worker.celery_app import app


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
