"""Query functions for fine-tuning jobs: who may open a job, one job, the lists.

A tenant's key opens its own organization's jobs only; any other job answers 404, as a
missing one does (``may_open``). Lists are newest first, by the ids of ``api.pagination``.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.jobs.pages import JobPageCache, PageKey
from api.jobs.schemas import jobs_page_json
from api.pagination import check_limit, page_newest_first
from control.db.job_versions import job_list_version
from control.db.models import ApiKey, Checkpoint, Job, JobEvent, Tenant
from control.errors import APIError, not_found


def tenant_jobs(tenant: Tenant):
    return select(Job).where(Job.tenant_id == tenant.id)


def may_open(job: Job, *, tenant_id: str, is_admin: bool) -> bool:
    """Whether a caller of organization ``tenant_id`` may read and act on ``job``.

    A tenant's key opens its own organization's jobs only; any other job answers 404,
    exactly like a missing one. An admin (``ApiKey.grants_admin``) opens every
    organization's jobs (it can already mint keys for any organization, so this grants
    nothing new); what it does there is recorded with actor ``admin``. Lists stay per
    organization either way. The API's job routes and the dashboard's job page both ask here.
    """
    return is_admin or job.tenant_id == tenant_id


def opens(key: ApiKey, job: Job | None) -> bool:
    """Whether ``key`` opens ``job`` (False for a missing one, which answers 404 alike)."""
    return job is not None and may_open(job, tenant_id=key.tenant_id, is_admin=key.grants_admin)


def get_job(session: Session, key: ApiKey, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if not opens(key, job):
        raise not_found("fine-tuning job", job_id)
    return job


def list_jobs(
    session: Session, tenant: Tenant, *, after: str | None, limit: int,
    metadata: dict[str, str], status: str | None = None,
) -> tuple[list[Job], bool]:
    query = tenant_jobs(tenant)
    for key, value in metadata.items():
        query = query.where(Job.metadata_[key].as_string() == value)
    if status is not None:
        query = query.where(Job.status == status)
    return page_newest_first(session, query, Job, after=after, limit=limit)


def list_jobs_json(
    session: Session, tenant: Tenant, *, after: str | None, limit: int,
    metadata: dict[str, str], status: str | None, pages: JobPageCache, query: bytes,
) -> bytes:
    """``list_jobs`` encoded as a ``JobsPublic`` page, reused from ``pages`` while the
    tenant's jobs are unchanged (see ``api.jobs.pages``); errors are never cached.

    ``query`` is the raw query string the other arguments were parsed from (the key).
    """
    key = PageKey(tenant.id, query)
    version = job_list_version(session, tenant.id)  # before the rows, never after
    body = pages.get(key, version)
    if body is None:
        rows, has_more = list_jobs(session, tenant, after=after, limit=limit,
                                   metadata=metadata, status=status)
        body = jobs_page_json(rows, has_more=has_more)
        pages.put(key, version, body)
    return body



def list_events(
    session: Session, job: Job, *, after: str | None, limit: int
) -> tuple[list[JobEvent], bool]:
    """Events newest first; ``after`` is an event id of this job."""
    check_limit(limit)
    query = select(JobEvent).where(JobEvent.job_id == job.id)
    if after is not None:
        anchor = session.scalar(
            select(JobEvent.seq).where(JobEvent.job_id == job.id, JobEvent.id == after)
        )
        if anchor is None:
            raise APIError(400, "invalid_cursor",
                           f"'after' is not an event of this job: '{after}'.", param="after")
        query = query.where(JobEvent.seq < anchor)
    rows = list(session.scalars(query.order_by(JobEvent.seq.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def list_checkpoints(
    session: Session, job: Job, *, after: str | None, limit: int
) -> tuple[list[Checkpoint], bool]:
    query = select(Checkpoint).where(Checkpoint.job_id == job.id)
    return page_newest_first(session, query, Checkpoint, after=after, limit=limit)
