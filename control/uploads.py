"""Where an upload's parts are kept, and the sweep that expires uploads left pending past
their ``expires_at`` (their parts deleted; an expired upload can no longer complete)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from control.artifacts import ArtifactStore
from control.db.base import utcnow
from control.db.models import Upload, UploadPart


def upload_folder(upload_id: str) -> str:
    """The file-store folder of an upload's parts."""
    return f"uploads/{upload_id}"


def expire_uploads(session: Session, *, store: ArtifactStore, now: dt.datetime | None = None,
                   limit: int = 500) -> list[str]:
    """Mark up to ``limit`` pending uploads past ``expires_at`` expired and delete their
    parts; returns their ids, oldest expiry first."""
    expired = session.scalars(
        select(Upload).where(Upload.status == "pending", Upload.expires_at <= (now or utcnow()))
        .order_by(Upload.expires_at).limit(limit).with_for_update(skip_locked=True)
    ).all()
    ids = [row.id for row in expired]
    for row in expired:
        row.status = "expired"
    if ids:
        session.execute(delete(UploadPart).where(UploadPart.upload_id.in_(ids)))
    session.commit()
    for upload_id in ids:
        store.delete_prefix(upload_folder(upload_id))
    return ids
