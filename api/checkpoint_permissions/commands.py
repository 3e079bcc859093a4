"""Command functions for checkpoint permissions: grant a model to tenants, revoke a grant.

A grant takes effect on the next request of the tenant it names (completions and
``/v1/models`` read the permissions on every request), and so does its deletion.
"""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.checkpoint_permissions.queries import PARAM, SharedModel
from control.db.base import utcnow
from control.db.models import CheckpointPermission, Tenant
from control.errors import APIError, not_found
from control.ids import new_id


def _checked_tenants(session: Session, shared: SharedModel, project_ids: list[str]) -> list[str]:
    """``project_ids`` without repeats, each an existing tenant other than the owner.

    Raises:
        APIError: 400 ``invalid_project_id`` (``param`` = ``project_ids[i]``).
    """
    unique = list(dict.fromkeys(project_ids))
    known = set(session.scalars(select(Tenant.id).where(Tenant.id.in_(unique))))
    for index, project_id in enumerate(project_ids):
        if project_id not in known:
            raise APIError(400, "invalid_project_id",
                           f"No organization of this service has the id '{project_id}'.",
                           param=f"project_ids[{index}]")
        if project_id == shared.job.tenant_id:
            raise APIError(400, "invalid_project_id",
                           f"'{project_id}' owns '{shared.name}' already; name other organizations.",
                           param=f"project_ids[{index}]")
    return unique


def grant(session: Session, shared: SharedModel, project_ids: list[str]) -> list[CheckpointPermission]:
    """Share ``shared`` with each tenant of ``project_ids``; returns their permissions in
    that order (a tenant already granted keeps its permission: granting is idempotent)."""
    tenants = _checked_tenants(session, shared, project_ids)
    for _attempt in range(2):
        existing = {row.project_id: row for row in session.scalars(select(CheckpointPermission).where(
            CheckpointPermission.model == shared.name, CheckpointPermission.project_id.in_(tenants)))}
        for project_id in tenants:
            if project_id not in existing:
                existing[project_id] = CheckpointPermission(
                    id=new_id("cp"), model=shared.name, job_id=shared.job.id, step=shared.step,
                    project_id=project_id, created_at=utcnow())
                session.add(existing[project_id])
        try:
            session.commit()
        except IntegrityError:
            session.rollback()  # a concurrent grant of the same tenant won: read it again
            continue
        return [existing[project_id] for project_id in tenants]
    raise APIError(409, "permission_conflict", "The permissions changed while they were granted; retry.",
                   param=PARAM)


def revoke(session: Session, shared: SharedModel, permission_id: str) -> None:
    """Delete the model's permission ``permission_id``; its tenant loses the model at once.

    Raises:
        APIError: 404 ``not_found`` for an id that is not a permission of this model.
    """
    deleted = session.execute(delete(CheckpointPermission).where(
        CheckpointPermission.id == permission_id, CheckpointPermission.model == shared.name))
    if deleted.rowcount == 0:  # type: ignore[attr-defined]
        session.rollback()
        raise not_found("checkpoint permission", permission_id, param="permission_id")
    session.commit()
