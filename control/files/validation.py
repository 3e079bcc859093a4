"""Validating an uploaded training file and applying the result (used by the Celery task).

The format rules live in ``trainers.common.formats`` (pure Python, shared with the
trainers), so the service and the trainers agree on what a valid file is by
construction. ``validate_file`` streams the file from the artifact store through the
validator (``VALIDATION_CHUNK`` bytes and one line at a time: memory stays flat up to the
upload limit, however short the lines), sets ``processed`` or ``error`` with the report, and advances the jobs that
waited for it. It is idempotent: a file already decided is left as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from sqlalchemy.orm import Session

from control.artifacts import ArtifactStore
from control.db.models import File
from control.jobs.queueing import advance_after_validation

log = logging.getLogger(__name__)

MAX_REPORTED_ERRORS = 50
VALIDATION_CHUNK = 64 * 1024


def validation_report(data: bytes | Iterable[bytes]) -> dict[str, Any]:
    """The validator's report as JSON-ready dict (errors with line numbers and codes), of
    the file's bytes or its chunks."""
    from trainers.common.formats import validate_jsonl

    return validate_jsonl(data, max_errors=MAX_REPORTED_ERRORS).to_dict()


def apply_validation(session: Session, file: File, report: dict[str, Any]) -> list[str]:
    """Record ``report`` on ``file`` and advance waiting jobs; returns ids of queued jobs."""
    file.validation = report
    if report.get("ok"):
        file.status = "processed"
        file.status_details = None
    else:
        file.status = "error"
        errors = report.get("errors") or []
        first = errors[0] if errors else {"code": "invalid_file", "message": "invalid file"}
        line = f"line {first.get('line')}: " if first.get("line") is not None else ""
        file.status_details = (
            f"{report.get('n_errors', len(errors))} problem(s); first: {line}"
            f"{first.get('code')}: {first.get('message')}"
        )
    session.flush()
    return advance_after_validation(session, file)


def validate_file(session: Session, store: ArtifactStore, file_id: str) -> list[str]:
    """Validate file ``file_id`` if not yet decided; the caller commits. Returns queued job ids."""
    file = session.get(File, file_id, with_for_update=True)
    if file is None or file.deleted_at is not None:
        log.info("file %s is gone; nothing to validate", file_id)
        return []
    if file.status != "uploaded":
        return advance_after_validation(session, file)
    report = validation_report(store.iter_bytes(file.location, chunk_size=VALIDATION_CHUNK))
    return apply_validation(session, file, report)
