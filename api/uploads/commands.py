"""Command functions for uploads: create, room for a part, add a part, complete, cancel,
and the expiry sweep (routes stay short; the sweep task reuses these).

An upload's parts live in the file store under ``uploads/<upload id>/``; completing the
upload writes them, in the client's order, into a new File (``files/<file id>.jsonl``)
and deletes them, as cancelling and expiring do. Rows are committed before objects are
deleted, so a crash in between leaves an unreferenced object, never a part row without
its bytes.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from sqlalchemy import delete
from sqlalchemy.orm import Session

from api.files import uploads as multipart
from api.files.commands import add_file, file_key
from api.uploads.assembly import Assembled, assemble
from api.uploads.queries import get_upload, parts_in_order, received, require_pending
from api.uploads.schemas import MAX_PARTS, UploadComplete, UploadCreate
from control.artifacts import ArtifactStore
from control.db.base import utcnow
from control.db.models import File, Tenant, Upload, UploadPart
from control.errors import APIError
from control.ids import new_id
from control.queue import VALIDATE_FILE, TaskQueue
from control.uploads import upload_folder

log = logging.getLogger(__name__)

# OpenAI's bounds: an upload expires an hour after it is created; a part holds at most 64 MB.
UPLOAD_TTL = dt.timedelta(hours=1)
MAX_PART_BYTES = 64 * 1024 * 1024



def size_mismatch(upload: Upload, message: str, *, param: str) -> APIError:
    return APIError(400, "upload_size_mismatch",
                    f"{message}; upload '{upload.id}' was created for {upload.bytes} bytes.", param=param)


def create_upload(session: Session, tenant: Tenant, body: UploadCreate, *, max_bytes: int) -> Upload:
    """A new pending upload of ``body.bytes`` bytes (at most ``max_bytes``), expiring in an hour.

    Raises:
        APIError: 413 ``file_too_large`` (``param`` = ``bytes``) over the upload limit.
    """
    if body.bytes > max_bytes:
        raise APIError(413, "file_too_large",
                       f"bytes is {body.bytes}, more than the upload limit of {max_bytes} bytes "
                       "(TUNEFLEET_MAX_UPLOAD_BYTES).", param="bytes")
    created = utcnow()
    row = Upload(
        id=new_id("upload"), tenant_id=tenant.id, filename=body.filename, bytes=body.bytes, purpose=body.purpose,
        mime_type=body.mime_type, status="pending", created_at=created, expires_at=created + UPLOAD_TTL,
        file_expires_after_s=body.expires_after.seconds if body.expires_after else None,
    )
    session.add(row)
    session.commit()
    return row


def _check_part_count(upload: Upload, count: int) -> None:
    if count >= MAX_PARTS:
        raise APIError(400, "too_many_parts", f"Upload '{upload.id}' already has {MAX_PARTS} parts, the most "
                       "an upload takes: send larger parts.", param="data")


@dataclass(frozen=True)
class PartRoom:
    """How many bytes the next part may hold, and the error past that."""

    limit: int
    too_large: APIError


def room_for_part(session: Session, tenant: Tenant, upload_id: str) -> PartRoom:
    """Check that a part may be added to the tenant's upload, before its body is read.

    The part may hold 64 MiB, and no more than the bytes still missing from the upload.
    The transaction is ended, so no connection is held while the body streams in.

    Raises:
        APIError: 404 (not the tenant's upload), 409 ``upload_not_pending``, 400
            ``too_many_parts`` or ``upload_size_mismatch`` (the parts already hold every byte).
    """
    try:
        upload = get_upload(session, tenant, upload_id)
        require_pending(upload, action="take parts")
        count, total = received(session, upload)
        _check_part_count(upload, count)
        missing = upload.bytes - total
        if missing <= 0:
            raise size_mismatch(upload, f"The parts already hold {total} bytes", param="data")
        if missing < MAX_PART_BYTES:
            return PartRoom(missing, size_mismatch(
                upload, f"This part is larger than the {missing} bytes the parts still miss", param="data"))
        return PartRoom(MAX_PART_BYTES, APIError(
            413, "file_too_large", f"A part holds at most {MAX_PART_BYTES} bytes (64 MiB).", param="data"))
    finally:
        session.rollback()


def add_part(session: Session, tenant: Tenant, upload_id: str, body: multipart.Upload, *,
             store: ArtifactStore) -> UploadPart:
    """Store a received part (its temporary file is moved) and record it.

    The checks of ``room_for_part`` are made again with the upload locked, so parts sent
    at the same time cannot together pass the upload's size; a part refused then is
    deleted from the store.
    """
    if body.size == 0:
        raise APIError(400, "empty_file", "The part is empty.", param="data")
    assert body.path is not None
    part_id = new_id("part")
    key = f"{upload_folder(upload_id)}/{part_id}.part"
    store.put_file(key, body.path, move=True)
    try:
        upload = get_upload(session, tenant, upload_id, lock=True)
        require_pending(upload, action="take parts")
        count, total = received(session, upload)
        _check_part_count(upload, count)
        if total + body.size > upload.bytes:
            raise size_mismatch(upload, f"With this part of {body.size} bytes the parts would hold "
                                f"{total + body.size} bytes", param="data")
        part = UploadPart(id=part_id, upload_id=upload.id, bytes=body.size, location=key, created_at=utcnow())
        session.add(part)
        session.commit()
    except BaseException:
        session.rollback()
        store.delete(key)
        raise
    return part


def complete_upload(session: Session, tenant: Tenant, upload_id: str, body: UploadComplete, *,
                    store: ArtifactStore, queue: TaskQueue) -> tuple[Upload, File]:
    """Put the upload's parts together, in ``body.part_ids`` order, into a new File and
    send its validation, as ``POST /v1/files`` does; the parts are then deleted.

    The parts are streamed outside any transaction; the upload is locked only to record
    the result, and an upload completed (or cancelled) by another request meanwhile
    keeps that request's result.

    Raises:
        APIError: 404; 409 ``upload_not_pending``; 400 ``invalid_part_ids``,
            ``upload_size_mismatch`` (the parts do not add up to ``bytes``),
            ``md5_mismatch`` or ``not_utf8``.
    """
    upload = get_upload(session, tenant, upload_id)
    require_pending(upload, action="be completed")
    parts = parts_in_order(session, upload, body.part_ids)
    total = sum(part.bytes for part in parts)
    if total != upload.bytes:
        raise size_mismatch(upload, f"The parts hold {total} bytes", param="part_ids")
    locations = [part.location for part in parts]
    session.rollback()  # no transaction (nor connection) held while the bytes are copied
    file_id = new_id("file")
    found = assemble(store, locations, file_key(file_id))
    try:
        _check_assembled(upload, found, body, total)
        upload = get_upload(session, tenant, upload_id, lock=True)
        require_pending(upload, action="be completed")
        parts_in_order(session, upload, body.part_ids)  # no part came or went meanwhile
        file = add_file(session, tenant, file_id, filename=upload.filename, size=found.size, sha256=found.sha256,
                        purpose=upload.purpose, expires_after_s=upload.file_expires_after_s)
        session.flush()  # the file row before the upload's reference to it
        upload.status, upload.file_id = "completed", file_id
        session.execute(delete(UploadPart).where(UploadPart.upload_id == upload.id))
        session.commit()
    except BaseException:
        session.rollback()
        store.delete(file_key(file_id))
        raise
    queue.send(VALIDATE_FILE, file_id)
    store.delete_prefix(upload_folder(upload.id))
    return upload, file


def _check_assembled(upload: Upload, found: Assembled, body: UploadComplete, expected: int) -> None:
    """The put-together file is what the parts' rows and the client say it is."""
    if found.size != expected:  # a part's object changed size under its row
        raise size_mismatch(upload, f"The stored parts hold {found.size} bytes", param="part_ids")
    if body.md5 is not None and found.md5 != body.md5.lower():
        raise APIError(400, "md5_mismatch",
                       f"The parts put together in the order of part_ids have md5 {found.md5}, not {body.md5}: "
                       "check the order of part_ids and each part's bytes.", param="md5")
    error = found.utf8.error(param="part_ids")
    if error is not None:
        raise error


def cancel_upload(session: Session, tenant: Tenant, upload_id: str, *, store: ArtifactStore) -> Upload:
    """Cancel a pending upload and delete its parts.

    Raises:
        APIError: 404; 409 ``upload_not_pending``.
    """
    upload = get_upload(session, tenant, upload_id, lock=True)
    require_pending(upload, action="be cancelled")
    upload.status = "cancelled"
    session.execute(delete(UploadPart).where(UploadPart.upload_id == upload.id))
    session.commit()
    store.delete_prefix(upload_folder(upload.id))
    return upload


