"""Merged exports as rows: one export per adapter at a time, a cap per tenant, reuse.

Merging copies the whole base model, so a careless or hostile client asking again and
again must not make a copy per request. ``request_export`` decides, under a lock on the
tenant's row (so two concurrent requests decide one after the other):

- an export of the same adapter (the job's final one, or a checkpoint's) and dtype that
  is queued or running is the answer: the request joins it;
- one of the same adapter in another dtype that is queued or running: 409
  ``export_in_progress`` (one export per adapter at a time);
- a finished one of the same adapter and dtype whose files are still registered is the
  answer (no new merge);
- otherwise, past ``TUNEFLEET_EXPORT_MAX_CONCURRENT_PER_TENANT`` queued or running exports
  of the tenant: 429 ``too_many_exports``; else a new export.

An export whose worker vanished would hold its adapter for good: one queued or running
for more than ``EXPORT_STALE_S`` without a change no longer counts as in progress.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import ColumnElement, exists, func, select
from sqlalchemy.orm import Session

from control.db.base import utcnow
from control.db.models import Artifact, Export, Job, Tenant
from control.db.session import begin_write
from control.errors import APIError
from control.ids import new_id

EXPORT_STALE_S = 2 * 3600
IN_PROGRESS = ("queued", "running")
EXPORTS_DIR = "exports"
TOO_MANY_RETRY_AFTER_S = 60


def request_export(session: Session, job: Job, checkpoint_id: str | None, dtype: str,
                   max_per_tenant: int) -> tuple[Export, bool]:
    """The export that answers this request, and whether it is new (a merge to send)."""
    begin_write(session)
    session.scalar(select(Tenant.id).where(Tenant.id == job.tenant_id).with_for_update())
    fresh_after = utcnow() - dt.timedelta(seconds=EXPORT_STALE_S)
    same_adapter = session.scalars(
        select(Export).where(Export.job_id == job.id, _checkpoint_is(checkpoint_id))
        .order_by(Export.created_at.desc())
    ).all()
    for row in same_adapter:
        if row.status in IN_PROGRESS and row.updated_at > fresh_after:
            if row.dtype == dtype:
                return row, False
            raise APIError(409, "export_in_progress",
                           f"Export {row.id} of this adapter ({row.dtype}) is still {row.status}; an adapter "
                           "is exported once at a time. Ask again when it has ended.")
    for row in same_adapter:
        if row.dtype == dtype and row.status == "succeeded" and _files_registered(session, row):
            return row, False
    running = session.scalar(select(func.count()).select_from(Export).where(
        Export.tenant_id == job.tenant_id, Export.status.in_(IN_PROGRESS), Export.updated_at > fresh_after))
    if running >= max_per_tenant:
        raise APIError(429, "too_many_exports",
                       f"This organization has {running} merged exports queued or running (at most "
                       f"{max_per_tenant} at once); retry after {TOO_MANY_RETRY_AFTER_S} s.",
                       headers={"Retry-After": str(TOO_MANY_RETRY_AFTER_S)})
    row = Export(id=new_id("ftexp"), job_id=job.id, tenant_id=job.tenant_id, checkpoint_id=checkpoint_id,
                 dtype=dtype, status="queued")
    session.add(row)
    session.flush()
    return row, True


def set_export_status(session: Session, export_id: str, status: str) -> None:
    """Record an export's progress (the worker's task); an export without a row is left be."""
    row = session.get(Export, export_id)
    if row is not None:
        row.status = status


def artifacts_prefix(export_id: str) -> str:
    return f"{EXPORTS_DIR}/{export_id}/"


def _checkpoint_is(checkpoint_id: str | None) -> ColumnElement[bool]:
    return Export.checkpoint_id.is_(None) if checkpoint_id is None else Export.checkpoint_id == checkpoint_id


def _files_registered(session: Session, row: Export) -> bool:
    prefix = artifacts_prefix(row.id)
    return bool(session.scalar(select(exists().where(Artifact.job_id == row.job_id,
                                                     Artifact.name.startswith(prefix, autoescape=True)))))
