"""File schemas: OpenAI's ``FileObject`` plus our ``validation`` report."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from api.schemas.common import ListPublic
from control.db.base import to_unix
from control.db.models import File


class FilePublic(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"]
    # OpenAI types both as a string and an integer: absent, not null, when there is none.
    status_details: str | None = Field(None, exclude_if=lambda value: value is None,
                                       description="Why validation failed (absent otherwise).")
    expires_at: int | None = Field(None, exclude_if=lambda value: value is None,
                                   description="When the file expires (set by the upload's "
                                   "expires_after); it is then deleted. Absent when it does not.")
    sha256: str
    validation: dict[str, Any] | None = None

    @classmethod
    def of(cls, row: File) -> FilePublic:
        return cls(
            id=row.id, bytes=row.bytes, created_at=to_unix(row.created_at) or 0,
            filename=row.filename, purpose=row.purpose, status=row.status,  # type: ignore[arg-type]
            status_details=row.status_details, expires_at=to_unix(row.expires_at), sha256=row.sha256,
            validation=row.validation,
        )


FilesPublic = ListPublic[FilePublic]


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True
