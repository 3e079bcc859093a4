"""``/v1/files``: upload, list, retrieve, content, delete (tenant-scoped)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from api.deps import CurrentTenant, FileStoreDep, QueueDep, SessionDep, SettingsDep
from api.errors import error_responses
from api.files import commands, queries
from api.files.schemas import FileDeleted, FilePublic, FilesPublic
from api.files.uploads import receive_upload
from api.responses import attachment, body_content
from api.schemas.common import PageAfter
from control.artifacts import open_or_404
from control.errors import not_found
from control.files.results import RESULTS_PURPOSE

router = APIRouter(prefix="/v1/files", tags=["files"])

# The body is read by api.files.uploads (streamed to disk with a size limit), not by FastAPI,
# so the route declares it here.
UPLOAD_BODY = {
    "required": True,
    "content": {"multipart/form-data": {"schema": {
        "type": "object",
        "required": ["purpose", "file"],
        "properties": {
            "purpose": {"type": "string", "enum": list(commands.PURPOSES)},
            "file": {"type": "string", "format": "binary",
                     "description": "JSONL training data, UTF-8, one example per line."},
            "expires_after": {
                "type": "object", "required": ["anchor", "seconds"],
                "description": "Delete the file this many seconds after its upload. OpenAI's SDK "
                               "sends the fields expires_after[anchor] and expires_after[seconds].",
                "properties": {
                    "anchor": {"type": "string", "enum": ["created_at"]},
                    "seconds": {"type": "integer", "minimum": commands.MIN_EXPIRY_S,
                                "maximum": commands.MAX_EXPIRY_S},
                },
            },
        },
    }}},
}


@router.post("", response_model=FilePublic, openapi_extra={"requestBody": UPLOAD_BODY},
             responses=error_responses(400, 401, 413))
async def upload_file(
    request: Request, session: SessionDep, tenant: CurrentTenant, settings: SettingsDep,
    store: FileStoreDep,
    queue: QueueDep,
) -> FilePublic:
    """Upload a JSONL training file (multipart: ``file``, ``purpose=fine-tune``)."""
    upload = await receive_upload(request, tmp_dir=settings.tmp_dir, limit=settings.max_upload_bytes)
    try:
        row = await run_in_threadpool(
            commands.create_file, session, tenant, upload, store=store,
            queue=queue,
        )
    finally:
        if upload.path is not None:
            upload.path.unlink(missing_ok=True)
    return FilePublic.of(row)


@router.get("", response_model=FilesPublic)
def list_files(
    session: SessionDep, tenant: CurrentTenant,
    purpose: str | None = None,
    after: PageAfter = None,
    limit: Annotated[int, Query(ge=1, le=queries.MAX_LIST_LIMIT, description="Page size.")]
    = queries.MAX_LIST_LIMIT,
    order: Annotated[Literal["asc", "desc"], Query(
        description="By creation time: newest first (desc) or oldest first (asc).")] = "desc",
) -> FilesPublic:
    rows, has_more = queries.list_files(session, tenant, purpose=purpose, after=after, limit=limit,
                                        order=order)
    data = [FilePublic.of(r) for r in rows]
    return FilesPublic.page(data, has_more=has_more)


@router.get("/{file_id}", response_model=FilePublic, responses=error_responses(404))
def retrieve_file(file_id: str, session: SessionDep, tenant: CurrentTenant) -> FilePublic:
    return FilePublic.of(queries.get_file(session, tenant, file_id))


@router.get("/{file_id}/content", response_model=None, response_class=Response, responses={
    **body_content("application/jsonl", "text/csv",
                   description="The file's bytes: an upload (JSONL) or a job's results (CSV)."),
    **error_responses(404),
})
def file_content(
    file_id: str, session: SessionDep, tenant: CurrentTenant, store: FileStoreDep
) -> StreamingResponse:
    row = queries.get_file(session, tenant, file_id)
    # A file being deleted has lost its content already: it is gone, as its row soon is.
    opened = open_or_404(store, row.location, not_found("file", file_id))
    # Uploads are JSONL; a job's results file is a CSV.
    media_type, suffix = ("text/csv", "csv") if row.purpose == RESULTS_PURPOSE else ("application/jsonl", "jsonl")
    return attachment(opened, filename=f"{row.id}.{suffix}", media_type=media_type)


@router.delete("/{file_id}", response_model=FileDeleted, responses=error_responses(404, 409))
def delete_file(
    file_id: str, session: SessionDep, tenant: CurrentTenant, store: FileStoreDep
) -> FileDeleted:
    commands.delete_file(session, tenant, file_id, store=store)
    return FileDeleted(id=file_id)
