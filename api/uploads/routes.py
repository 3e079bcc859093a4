"""``/v1/uploads``: create an upload, add its parts, complete it into a File, or cancel it
(tenant-scoped; another tenant's upload is a 404)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from api.deps import CurrentTenant, FileStoreDep, QueueDep, SessionDep, SettingsDep
from api.errors import error_responses
from api.files.schemas import FilePublic
from api.files.uploads import receive_upload
from api.uploads import commands
from api.uploads.schemas import UploadComplete, UploadCreate, UploadPartPublic, UploadPublic

router = APIRouter(prefix="/v1/uploads", tags=["uploads"])

# The part's body is streamed to disk by api.files.uploads under the part's own limit, not
# read by FastAPI, so the route declares it here.
PART_BODY = {
    "required": True,
    "content": {"multipart/form-data": {"schema": {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "string", "format": "binary",
                     "description": "The part's bytes: at most 64 MiB, and at most the bytes the upload "
                                    "still misses."},
        },
    }}},
}


@router.post("", response_model=UploadPublic, responses=error_responses(400, 413))
def create_upload(body: UploadCreate, session: SessionDep, tenant: CurrentTenant,
                  settings: SettingsDep) -> UploadPublic:
    """Start an upload of ``bytes`` bytes; add its parts within the hour it stays pending."""
    row = commands.create_upload(session, tenant, body, max_bytes=settings.max_upload_bytes)
    return UploadPublic.of(row)


@router.post("/{upload_id}/parts", response_model=UploadPartPublic, openapi_extra={"requestBody": PART_BODY},
             responses=error_responses(400, 404, 409, 413))
async def add_upload_part(upload_id: str, request: Request, session: SessionDep, tenant: CurrentTenant,
                          settings: SettingsDep, store: FileStoreDep) -> UploadPartPublic:
    """Add a part (multipart ``data``); the upload is checked before its body is read."""
    room = await run_in_threadpool(commands.room_for_part, session, tenant, upload_id)
    body = await receive_upload(request, tmp_dir=settings.tmp_dir, limit=room.limit, too_large=room.too_large,
                                file_field="data", form="a 'data' field", binary_field=True, check_utf8=False)
    try:
        part = await run_in_threadpool(commands.add_part, session, tenant, upload_id, body, store=store)
    finally:
        if body.path is not None:
            body.path.unlink(missing_ok=True)
    return UploadPartPublic.of(part)


@router.post("/{upload_id}/complete", response_model=UploadPublic, responses=error_responses(400, 404, 409))
def complete_upload(upload_id: str, body: UploadComplete, session: SessionDep, tenant: CurrentTenant,
                    store: FileStoreDep, queue: QueueDep) -> UploadPublic:
    """Put the parts together, in the order of ``part_ids``, into a File (validated as an
    upload to ``/v1/files`` is); the answer holds it."""
    upload, file = commands.complete_upload(session, tenant, upload_id, body, store=store, queue=queue)
    session.refresh(file)  # the validation may have run already
    return UploadPublic.of(upload, file=FilePublic.of(file))


@router.post("/{upload_id}/cancel", response_model=UploadPublic, responses=error_responses(404, 409))
def cancel_upload(upload_id: str, session: SessionDep, tenant: CurrentTenant, store: FileStoreDep) -> UploadPublic:
    """Cancel a pending upload; its parts are deleted."""
    row = commands.cancel_upload(session, tenant, upload_id, store=store)
    return UploadPublic.of(row)
