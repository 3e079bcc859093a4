"""Upload schemas: OpenAI's ``Upload`` and ``UploadPart`` objects and the two request bodies."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from api.files.commands import MAX_EXPIRY_S, MIN_EXPIRY_S
from api.files.schemas import FilePublic
from api.schemas.common import AcceptWholeFloats, PublicObject, Strict
from api.uploads.queries import status_now
from control.db.base import to_unix
from control.db.models import Upload, UploadPart

# S3 puts at most 10,000 parts in one object, and so does an upload here.
MAX_PARTS = 10_000

Printable = Annotated[str, StringConstraints(min_length=1, max_length=255, pattern=r"^[^\x00-\x1f\x7f]*$")]


class FileExpiresAfter(Strict):
    """When the File made from the upload expires, as ``POST /v1/files`` takes it."""

    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(strict=True, ge=MIN_EXPIRY_S, le=MAX_EXPIRY_S), AcceptWholeFloats]


class UploadCreate(Strict):
    """``POST /v1/uploads``."""

    bytes: Annotated[int, Field(strict=True, ge=1, le=2**62, description="The file's size; the parts must add "
                                "up to it (at most TUNEFLEET_MAX_UPLOAD_BYTES)."), AcceptWholeFloats]
    filename: Printable
    mime_type: Printable
    purpose: Literal["fine-tune"]
    expires_after: FileExpiresAfter | None = None


class UploadComplete(Strict):
    """``POST /v1/uploads/{upload_id}/complete``."""

    part_ids: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(
        min_length=1, max_length=MAX_PARTS, description="Every part of the upload, once each, in the file's order.")
    md5: Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{32}$")] | None = Field(
        None, description="The md5 of the whole file (hex): the parts put together in this order must match it.")


class UploadPublic(PublicObject):
    """OpenAI's ``upload``; ``file`` is the File once the upload is completed."""

    id: str
    object: Literal["upload"] = "upload"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["pending", "completed", "cancelled", "expired"]
    expires_at: int
    file: FilePublic | None = None

    @classmethod
    def of(cls, row: Upload, *, file: FilePublic | None = None) -> UploadPublic:
        return cls(
            id=row.id, bytes=row.bytes, created_at=to_unix(row.created_at) or 0, filename=row.filename,
            purpose=row.purpose, status=status_now(row),  # type: ignore[arg-type]
            expires_at=to_unix(row.expires_at) or 0, file=file,
        )


class UploadPartPublic(PublicObject):
    """OpenAI's ``upload.part``."""

    id: str
    object: Literal["upload.part"] = "upload.part"
    created_at: int
    upload_id: str

    @classmethod
    def of(cls, row: UploadPart) -> UploadPartPublic:
        return cls(id=row.id, created_at=to_unix(row.created_at) or 0, upload_id=row.upload_id)
