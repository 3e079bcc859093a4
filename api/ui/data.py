"""The dashboard's own JSON endpoints (``/ui/api/...``), for views the public API lacks.

The public API is OpenAI-shaped and strictly tenant-scoped; a dashboard needs two more
things, served here with the same objects (``JobPublic``) and the same query helpers:

- ``GET /ui/api/jobs``: the jobs table — the public list plus server-side filters
  (status, pool, search) and, for admins, every tenant's jobs with a tenant filter; each
  row carries its tenant's name and its latest metric (loss, tokens/s), so the table
  needs one request, not one per row.
- ``GET /ui/api/hyperparameters``: what ``"auto"`` resolves to for a training file, with
  the API's own resolver, so the new-job form shows the numbers the job will get.

Both authenticate with the dashboard session only (never a Bearer key: these are not
part of the public API and may change with the dashboard).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy import func, or_, select

from api.deps import SessionDep
from api.files.queries import get_file
from api.jobs.schemas import JobPublic
from api.pagination import page_newest_first
from api.ui import session as ui_session
from control.db.models import JOB_STATUSES, ApiKey, Job, JobMetric, Tenant
from control.errors import APIError
from control.jobs.hyperparameters import resolve_hyperparameters

router = APIRouter(prefix="/ui/api", include_in_schema=False)

LATEST_METRIC_FIELDS = ("step", "total_steps", "train_loss", "valid_loss", "tokens_per_s", "time")


def session_key(request: Request, db: SessionDep) -> ApiKey:
    key = ui_session.session_api_key(db, request)
    if key is None:
        raise APIError(401, "invalid_session", "Sign in to the dashboard first.")
    return key


SessionKey = Annotated[ApiKey, Depends(session_key)]


@router.get("/jobs", response_model=dict[str, Any])
def dashboard_jobs(
    db: SessionDep,
    key: SessionKey,
    status: Annotated[str | None, Query()] = None,
    pool: Annotated[str | None, Query(max_length=128)] = None,
    tenant: Annotated[str | None, Query(max_length=64)] = None,
    q: Annotated[str | None, Query(max_length=200)] = None,
    after: str | None = None,
    limit: Annotated[int, Query()] = 20,
) -> dict[str, Any]:
    """One page of jobs for the dashboard table (newest first, cursor ``after``)."""
    query = select(Job)
    if key.grants_admin:
        if tenant:
            query = query.where(Job.tenant_id == tenant)
    else:
        query = query.where(Job.tenant_id == key.tenant_id)
    if status:
        if status not in JOB_STATUSES:
            raise APIError(400, "invalid_request", f"Unknown status '{status}'.", param="status")
        query = query.where(Job.status == status)
    if pool:
        query = query.where(Job.pool == pool)
    if q and q.strip():
        # LIKE on a bounded user string; % and _ are escaped so they match literally.
        needle = "%" + q.strip().replace("\\", "\\\\").replace("%", r"\%").replace("_", r"\_") + "%"
        query = query.where(
            or_(
                Job.id.ilike(needle, escape="\\"),
                Job.model.ilike(needle, escape="\\"),
                Job.suffix.ilike(needle, escape="\\"),
            )
        )
    jobs, has_more = page_newest_first(db, query, Job, after=after, limit=limit)
    tenant_names = _tenant_names(db, {j.tenant_id for j in jobs})
    latest = _latest_metrics(db, [j.id for j in jobs])
    data = []
    for job in jobs:
        row = JobPublic.of(job).model_dump()
        row["tenant_name"] = tenant_names.get(job.tenant_id)
        row["latest_metric"] = latest.get(job.id)
        data.append(row)
    return {
        "object": "list",
        "data": data,
        "has_more": has_more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


@router.get("/tenants", response_model=dict[str, Any])
def dashboard_tenants(db: SessionDep, key: SessionKey) -> dict[str, Any]:
    """Tenants for the admin's tenant filter (a tenant key sees only its own)."""
    query = select(Tenant).order_by(Tenant.name)
    if not key.grants_admin:
        query = query.where(Tenant.id == key.tenant_id)
    return {"object": "list", "data": [{"id": t.id, "name": t.name} for t in db.scalars(query)]}


def _tenant_names(db: SessionDep, ids: set[str]) -> dict[str, str]:
    if not ids:
        return {}
    return dict(db.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(ids))).all())


def _latest_metrics(db: SessionDep, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The newest metric row of each job (highest step), in one query."""
    if not job_ids:
        return {}
    newest = (
        select(JobMetric.job_id, func.max(JobMetric.step).label("step"))
        .where(JobMetric.job_id.in_(job_ids))
        .group_by(JobMetric.job_id)
        .subquery()
    )
    rows = db.scalars(
        select(JobMetric).join(
            newest, (JobMetric.job_id == newest.c.job_id) & (JobMetric.step == newest.c.step)
        )
    )
    return {m.job_id: {f: getattr(m, f) for f in LATEST_METRIC_FIELDS} for m in rows}


@router.get("/hyperparameters", response_model=dict[str, Any])
def resolved_hyperparameters(
    db: SessionDep,
    key: SessionKey,
    training_file: str,
    n_epochs: str = "auto",
    batch_size: str = "auto",
    learning_rate_multiplier: str = "auto",
    max_steps: Annotated[int | None, Query(ge=1)] = None,
    method: Literal["supervised", "dpo"] = "supervised",
    beta: str = "auto",
) -> dict[str, Any]:
    """What "auto" resolves to for ``training_file`` (the creation route's own rule); a
    ``dpo`` method also resolves ``beta`` (OpenAI's range, 0 < beta <= 2)."""
    file = get_file(db, key.tenant, training_file, param="training_file")
    n_examples = int((file.validation or {}).get("n_examples") or 0)
    if file.status != "processed" or n_examples < 1:
        raise APIError(
            400, "file_not_ready", "The training file is not validated yet.", param="training_file"
        )
    requested: dict[str, Any] = {
        "n_epochs": _auto_or_number(n_epochs, int, "n_epochs"),
        "batch_size": _auto_or_number(batch_size, int, "batch_size"),
        "learning_rate_multiplier": _auto_or_number(
            learning_rate_multiplier, float, "learning_rate_multiplier"
        ),
        "max_steps": max_steps,
    }
    if method == "dpo":
        requested["beta"] = _auto_or_number(beta, float, "beta")
        if requested["beta"] != "auto" and requested["beta"] > 2:
            raise APIError(400, "invalid_request", "beta must be at most 2.", param="beta")
    return {
        "training_file": file.id,
        "n_examples": n_examples,
        "hyperparameters": resolve_hyperparameters(requested, n_examples, method=method),
    }


def _auto_or_number(value: str, kind: type, name: str) -> Any:
    if value == "auto":
        return "auto"
    try:
        number = kind(value)
    except ValueError:
        raise APIError(
            400, "invalid_request", f"{name} must be 'auto' or a number.", param=name
        ) from None
    if number <= 0:
        raise APIError(400, "invalid_request", f"{name} must be positive.", param=name)
    return number
