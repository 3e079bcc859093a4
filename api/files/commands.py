"""Command functions for uploaded files: upload, expiry, delete, the expiry sweep and a
finished job's results file (routes stay short; tasks reuse these). The reads are in
``api.files.queries``."""

from __future__ import annotations

import datetime as dt
import json

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.files.queries import get_file
from api.files.uploads import Upload
from control.artifacts import ArtifactStore
from control.db.base import utcnow
from control.db.models import File, Tenant
from control.errors import APIError
from control.files.retention import used_by_unfinished_job
from control.ids import new_id
from control.queue import VALIDATE_FILE, TaskQueue

PURPOSES = ("fine-tune",)
# OpenAI's bounds on ``expires_after.seconds``: one hour to thirty days after the upload.
MIN_EXPIRY_S = 3600
MAX_EXPIRY_S = 30 * 24 * 3600


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



def delete_file(session: Session, tenant: Tenant, file_id: str, *, store: ArtifactStore) -> None:
    """Delete a file unless a job that has not finished still needs it (409 ``file_in_use``)."""
    row = get_file(session, tenant, file_id)
    if session.scalar(select(used_by_unfinished_job(file_id))):
        raise APIError(409, "file_in_use",
                       f"File '{file_id}' is used by a job that has not finished.")
    row.deleted_at = utcnow()
    session.commit()
    store.delete(row.location)




