"""Query functions for uploaded files: a tenant's live files, one file, the list."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from api.pagination import page_by_created
from control.db.base import utcnow
from control.db.models import File, Tenant
from control.errors import not_found

# OpenAI's list files returns up to 10,000 files a page, and that many by default.
MAX_LIST_LIMIT = 10_000


def tenant_files(tenant: Tenant, *, now: dt.datetime | None = None):
    """The tenant's files that are neither deleted nor expired.

    An expired file a job still uses stays in storage until that job ends (the expiry
    sweep waits for it), but the tenant no longer sees it or starts new jobs on it.
    """
    return select(File).where(
        File.tenant_id == tenant.id, File.deleted_at.is_(None),
        or_(File.expires_at.is_(None), File.expires_at > (now or utcnow())),
    )


def get_file(session: Session, tenant: Tenant, file_id: str, *, param: str | None = None) -> File:
    """The tenant's live file, else 404 (another tenant's file is 'not found' too)."""
    row = session.scalar(tenant_files(tenant).where(File.id == file_id))
    if row is None:
        raise not_found("file", file_id, param=param)
    return row


def list_files(
    session: Session, tenant: Tenant, *, purpose: str | None, after: str | None, limit: int,
    order: Literal["asc", "desc"] = "desc",
) -> tuple[list[File], bool]:
    query = tenant_files(tenant)
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    return page_by_created(session, query, File, after=after, limit=limit, order=order,
                           max_limit=MAX_LIST_LIMIT)
