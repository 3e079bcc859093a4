"""Query functions for checkpoint permissions: which model a name shares, who may manage
its permissions, and what is shared with a tenant.

A shareable model is named as completions name it (``api.inference.served_models``): a
checkpoint, ``<fine-tuned model>:ckpt-step-<N>`` (its ``fine_tuned_model_checkpoint``),
or a succeeded job's ``fine_tuned_model`` itself, as OpenAI's own examples address it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sqlalchemy import and_, exists, or_, select
from sqlalchemy.orm import Session

from api.models.fine_tuned import tenant_adapters
from api.pagination import page_by_created
from control.db.models import ApiKey, Artifact, Checkpoint, CheckpointPermission, Job
from control.errors import APIError, not_found
from control.jobs.naming import parse_model_name
from control.reports.ingest import ADAPTER_WEIGHTS

PARAM = "fine_tuned_model_checkpoint"


@dataclass(frozen=True)
class SharedModel:
    """A model that may be shared: its name, the job that made it, the checkpoint's step
    (None for the job's final model)."""

    name: str
    job: Job
    step: int | None


def find_shareable(session: Session, name: str) -> SharedModel | None:
    """The checkpoint or fine-tuned model ``name`` names, of any tenant; None if there is none."""
    parts = parse_model_name(name)
    job = session.get(Job, parts.job_id) if parts is not None else None
    if job is None or not parts.names(job):
        return None
    if parts.step is not None:
        step = parts.step
        found = session.scalar(select(Checkpoint.id).where(Checkpoint.job_id == job.id, Checkpoint.step == step))
        return SharedModel(name, job, step) if found is not None else None
    final = session.scalar(tenant_adapters(job.tenant_id).where(Job.id == job.id))
    return SharedModel(name, job, None) if final is not None and job.fine_tuned_model == name else None


def managed_model(session: Session, key: ApiKey, name: str) -> SharedModel:
    """The model ``name``, if ``key`` may manage its permissions: its tenant's or an admin's.

    Raises:
        APIError: 403 ``permission_denied`` for a tenant the model is shared with; 404
            ``not_found`` for anything else (another tenant's model is not confirmed to exist).
    """
    shared = find_shareable(session, name)
    if shared is not None and (shared.job.tenant_id == key.tenant_id or key.grants_admin):
        return shared
    if shared is not None and sharing_owner(session, name, key.tenant_id) is not None:
        raise APIError(403, "permission_denied",
                       f"'{name}' is shared with your organization; only the organization that owns it "
                       "manages its permissions.", param=PARAM)
    raise not_found("fine-tuned model checkpoint", name, param=PARAM)


def sharing_owner(session: Session, model: str, tenant_id: str) -> str | None:
    """The tenant that owns ``model``, when it shares it with ``tenant_id``; else None."""
    return session.scalar(
        select(Job.tenant_id).join(CheckpointPermission, CheckpointPermission.job_id == Job.id)
        .where(CheckpointPermission.model == model, CheckpointPermission.project_id == tenant_id)
    )


def shared_with(session: Session, tenant_id: str) -> list[tuple[CheckpointPermission, Job]]:
    """The models other tenants share with ``tenant_id`` and that still exist, oldest grant first."""
    still_there = or_(
        and_(CheckpointPermission.step.is_not(None),
             exists().where(Checkpoint.job_id == Job.id, Checkpoint.step == CheckpointPermission.step)),
        and_(CheckpointPermission.step.is_(None), Job.status == "succeeded",
             exists().where(Artifact.job_id == Job.id, Artifact.name == ADAPTER_WEIGHTS)),
    )
    rows = session.execute(
        select(CheckpointPermission, Job).join(Job, Job.id == CheckpointPermission.job_id)
        .where(CheckpointPermission.project_id == tenant_id, still_there)
        .order_by(CheckpointPermission.created_at, CheckpointPermission.id)
    )
    return [(permission, job) for permission, job in rows.tuples()]


def list_permissions(
    session: Session, shared: SharedModel, *, project_id: str | None, after: str | None, limit: int,
    order: Literal["ascending", "descending"],
) -> tuple[list[CheckpointPermission], bool]:
    """One page of the model's permissions (optionally those of one tenant)."""
    query = select(CheckpointPermission).where(CheckpointPermission.model == shared.name)
    if project_id is not None:
        query = query.where(CheckpointPermission.project_id == project_id)
    return page_by_created(session, query, CheckpointPermission, after=after, limit=limit,
                           order="asc" if order == "ascending" else "desc")
