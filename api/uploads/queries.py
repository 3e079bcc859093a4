"""Query functions for uploads: a tenant's upload, its status now, its parts in a given order."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control.db.base import utcnow
from control.db.models import Tenant, Upload, UploadPart
from control.errors import APIError, not_found


def get_upload(session: Session, tenant: Tenant, upload_id: str, *, lock: bool = False) -> Upload:
    """The tenant's upload, else 404 (another tenant's upload is 'not found' too)."""
    query = select(Upload).where(Upload.id == upload_id, Upload.tenant_id == tenant.id)
    row = session.scalar(query.with_for_update() if lock else query)
    if row is None:
        raise not_found("upload", upload_id)
    return row


def status_now(upload: Upload, *, now: dt.datetime | None = None) -> str:
    """The upload's status as OpenAI shows it: a pending upload past ``expires_at`` is
    ``expired`` even before the sweep has deleted its parts."""
    if upload.status == "pending" and upload.expires_at <= (now or utcnow()):
        return "expired"
    return upload.status


def require_pending(upload: Upload, *, action: str) -> None:
    """409 ``upload_not_pending`` unless parts may still be added to the upload."""
    status = status_now(upload)
    if status != "pending":
        raise APIError(409, "upload_not_pending",
                       f"Upload '{upload.id}' is {status}: it cannot {action} any more"
                       f"{'; create a new upload' if status != 'completed' else ''}.")


def received(session: Session, upload: Upload) -> tuple[int, int]:
    """(parts, bytes) the upload holds so far."""
    count, total = session.execute(
        select(func.count(), func.coalesce(func.sum(UploadPart.bytes), 0)).where(UploadPart.upload_id == upload.id)
    ).one()
    return int(count), int(total)


def parts_in_order(session: Session, upload: Upload, part_ids: list[str]) -> list[UploadPart]:
    """The upload's parts in the order of ``part_ids``, which must name each of them once.

    Raises:
        APIError: 400 ``invalid_part_ids`` (``param`` = ``part_ids[i]``) for an id named
            twice or not a part of this upload (a part of another upload included), or
            ``part_ids`` when a part of the upload is left out.
    """
    parts = {p.id: p for p in session.scalars(select(UploadPart).where(UploadPart.upload_id == upload.id))}
    seen: set[str] = set()
    for index, part_id in enumerate(part_ids):
        if part_id in seen:
            raise APIError(400, "invalid_part_ids", f"Part '{part_id}' is listed twice.",
                           param=f"part_ids[{index}]")
        if part_id not in parts:
            raise APIError(400, "invalid_part_ids", f"'{part_id}' is not a part of upload '{upload.id}'.",
                           param=f"part_ids[{index}]")
        seen.add(part_id)
    missing = [part_id for part_id in parts if part_id not in seen]
    if missing:
        raise APIError(400, "invalid_part_ids",
                       f"part_ids leaves out {len(missing)} part(s) of upload '{upload.id}' "
                       f"(first: '{missing[0]}'): list every part, in the file's order.", param="part_ids")
    return [parts[part_id] for part_id in part_ids]
