"""Command functions for uploaded files: upload, expiry, delete, the expiry sweep and a
finished job's results file (routes stay short; tasks reuse these). The reads are in
``api.files.queries``."""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import io
import json
from collections.abc import Iterable
from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from api.artifacts import ArtifactStore
from api.db.base import utcnow
from api.db.models import TERMINAL_STATUSES, File, Job, JobMetric, Tenant
from api.errors import APIError
from api.files.queries import get_file
from api.files.uploads import Upload
from api.ids import new_id
from api.queue import VALIDATE_FILE, TaskQueue

PURPOSES = ("fine-tune",)
# OpenAI's bounds on ``expires_after.seconds``: one hour to thirty days after the upload.
MIN_EXPIRY_S = 3600
MAX_EXPIRY_S = 30 * 24 * 3600
RESULTS_PURPOSE = "fine-tune-results"  # written by the service for a finished job
RESULTS_FILENAME = "step_metrics.csv"
# OpenAI's results CSV columns, and the stored metric each one is read from.
RESULTS_COLUMNS = {
    "step": "step",
    "train_loss": "train_loss",
    "train_accuracy": "token_accuracy",
    "valid_loss": "valid_loss",
    "valid_mean_token_accuracy": "valid_token_accuracy",
}


def file_key(file_id: str) -> str:
    """Artifact-store key of a file's content."""
    return f"files/{file_id}.jsonl"


def clean_filename(name: str | None) -> str:
    """The client's file name without directories or control characters, at most 255 chars."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(c for c in base if c.isprintable()).strip()
    return base[:255] or "upload.jsonl"


def create_file(
    session: Session, tenant: Tenant, upload: Upload, *, store: ArtifactStore, queue: TaskQueue
) -> File:
    """Store an upload as a new file (status ``uploaded``) and enqueue its validation."""
    purpose = upload.fields.get("purpose")
    if purpose is None:
        raise APIError(400, "invalid_request", "Missing required parameter: 'purpose'.",
                       param="purpose")
    if purpose not in PURPOSES:
        raise APIError(400, "invalid_request",
                       f"purpose must be one of {', '.join(PURPOSES)}; got '{purpose}'.",
                       param="purpose")
    expires_after_s = expiry_seconds(upload.fields)
    if upload.size == 0:
        raise APIError(400, "empty_file", "The file is empty.", param="file")
    assert upload.path is not None
    file_id = new_id("file")
    store.put_file(file_key(file_id), upload.path, move=True)
    row = add_file(session, tenant, file_id, filename=upload.filename, size=upload.size, sha256=upload.sha256,
                   purpose=purpose, expires_after_s=expires_after_s)
    session.commit()
    queue.send(VALIDATE_FILE, file_id)
    return row


def add_file(
    session: Session, tenant: Tenant, file_id: str, *, filename: str | None, size: int, sha256: str,
    purpose: str, expires_after_s: int | None,
) -> File:
    """Add the row of a new file (status ``uploaded``) whose content is already stored at
    ``file_key(file_id)``; the caller commits, then sends its validation."""
    created = utcnow()
    row = File(
        id=file_id, tenant_id=tenant.id, filename=clean_filename(filename), bytes=size, purpose=purpose,
        status="uploaded", location=file_key(file_id), sha256=sha256, created_at=created,
        expires_at=None if expires_after_s is None else created + dt.timedelta(seconds=expires_after_s),
    )
    session.add(row)
    return row


def expiry_seconds(fields: dict[str, str]) -> int | None:
    """The upload's ``expires_after.seconds``, or None when it sets no expiry.

    OpenAI's SDK sends the object as form fields ``expires_after[anchor]`` and
    ``expires_after[seconds]``; a client following the OpenAPI document may send one
    ``expires_after`` part holding the JSON object. Both mean the same.
    """
    if "expires_after" in fields:
        try:
            policy = json.loads(fields["expires_after"])
        except ValueError:
            policy = None
        if not isinstance(policy, dict):
            raise APIError(400, "invalid_request",
                           "expires_after must be an object {\"anchor\": \"created_at\", \"seconds\": N}.",
                           param="expires_after")
    else:
        policy = {name: fields[f"expires_after[{name}]"] for name in ("anchor", "seconds")
                  if f"expires_after[{name}]" in fields}
        if not policy:
            return None
    if policy.get("anchor") != "created_at":
        raise APIError(400, "invalid_request",
                       "expires_after.anchor must be 'created_at' (the only supported anchor).",
                       param="expires_after.anchor")
    seconds = policy.get("seconds")
    if isinstance(seconds, str) and seconds.strip().isdigit():
        seconds = int(seconds)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not MIN_EXPIRY_S <= seconds <= MAX_EXPIRY_S:
        raise APIError(400, "invalid_request",
                       f"expires_after.seconds must be an integer from {MIN_EXPIRY_S} (1 hour) to "
                       f"{MAX_EXPIRY_S} (30 days); got {seconds!r}.",
                       param="expires_after.seconds")
    return seconds


def used_by_unfinished_job(file_id: Any):
    """A SQL condition: a job that has not finished trains on, or validates with, the file
    (an id, or ``File.id`` in a query over files)."""
    return exists().where(
        (Job.training_file == file_id) | (Job.validation_file == file_id),
        Job.status.not_in(TERMINAL_STATUSES),
    )


def delete_file(session: Session, tenant: Tenant, file_id: str, *, store: ArtifactStore) -> None:
    """Delete a file unless a job that has not finished still needs it (409 ``file_in_use``)."""
    row = get_file(session, tenant, file_id)
    if session.scalar(select(used_by_unfinished_job(file_id))):
        raise APIError(409, "file_in_use",
                       f"File '{file_id}' is used by a job that has not finished.")
    row.deleted_at = utcnow()
    session.commit()
    store.delete(row.location)


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


def results_csv(metrics: Iterable[JobMetric]) -> bytes:
    """OpenAI's per-step results CSV of ``metrics`` (a header, then one row per step).

    A metric the trainer did not report (no validation set, a NaN stored as null) is an
    empty cell. Floats are written with ``repr``, so they read back exactly.
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(RESULTS_COLUMNS)
    for row in metrics:
        writer.writerow("" if (v := getattr(row, attr)) is None else v for attr in RESULTS_COLUMNS.values())
    return out.getvalue().encode()


def create_result_file(session: Session, job: Job, *, store: ArtifactStore) -> File:
    """Store ``job``'s metrics as a ``fine-tune-results`` file of its tenant; the caller commits.

    The content is written to ``store`` (the files API's storage) before the row is added:
    if the caller's transaction then fails, an unreferenced blob is left, never a file row
    without content. Put the returned id into ``job.result_files`` in the same transaction.
    """
    metrics = session.scalars(select(JobMetric).where(JobMetric.job_id == job.id).order_by(JobMetric.step))
    content = results_csv(metrics)
    file_id = new_id("file")
    key = f"files/{file_id}.csv"
    store.put_bytes(key, content)
    row = File(
        id=file_id, tenant_id=job.tenant_id, filename=RESULTS_FILENAME, bytes=len(content),
        purpose=RESULTS_PURPOSE, status="processed", location=key,
        sha256=hashlib.sha256(content).hexdigest(),
    )
    session.add(row)
    return row
