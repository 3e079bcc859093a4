"""``GET /v1/usage``: GPU-seconds and cost per pool, per tenant, over a time range.

The rows are the jobs' ``usage`` columns (segments of held GPUs, written by the
scheduler when it admits a job and when the job leaves ``running``; see
``scheduling.usage``); the query here picks the jobs that can overlap the range and
``scheduling.usage.sum_usage`` clips and sums their segments.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from control.db.models import ApiKey, Job, Tenant
from control.errors import APIError, not_found
from scheduling.usage import sum_usage


def to_timestamp(value: dt.datetime | float | None) -> float | None:
    """Unix seconds of a datetime (naive: UTC, as SQLite returns them); numbers as given."""
    if value is None or isinstance(value, (int, float)):
        return value
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.timestamp()


def tenant_usage(session: Session, tenant_id: str | None, start: dt.datetime | float | None = None,
                 end: dt.datetime | float | None = None, *, now: float) -> dict[str, Any]:
    """GPU-seconds and cost per pool for a tenant (None: every tenant) within [start, end).

    Returns ``{"object": "usage", "tenant_id", "start", "end", "gpu_seconds", "cost",
    "by_pool": {pool: {"gpu_seconds", "cost"}}, "jobs": n}``.
    """
    s, e = to_timestamp(start), to_timestamp(end)
    q = select(Job.usage).where(Job.usage.is_not(None))
    if tenant_id is not None:
        q = q.where(Job.tenant_id == tenant_id)
    if s is not None:
        # jobs that finished before the range cannot overlap it
        q = q.where(or_(Job.finished_at.is_(None), Job.finished_at >= dt.datetime.fromtimestamp(s, dt.UTC)))
    totals = sum_usage(session.scalars(q), s, e, now=now)
    return {"object": "usage", "tenant_id": tenant_id, "start": s, "end": e, **totals}


def parse_time(value: str | None, param: str) -> float | None:
    """Unix seconds or an ISO 8601 date/time (UTC when no zone is given)."""
    if value is None or value == "":
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            parsed = dt.datetime.fromisoformat(value)
        except ValueError:
            raise APIError(
                400,
                "invalid_request",
                f"{param} must be Unix seconds or an ISO 8601 time; got '{value}'.",
                param=param,
            ) from None
        return to_timestamp(parsed)
    if not math.isfinite(seconds) or seconds < 0:
        raise APIError(
            400,
            "invalid_request",
            f"{param} must be a finite time >= 0; got '{value}'.",
            param=param,
        )
    return seconds


def usage_report(
    session: Session,
    key: ApiKey,
    *,
    start: str | None,
    end: str | None,
    tenant: str | None,
    now: float | None = None,
) -> dict[str, Any]:
    """``GET /v1/usage``: GPU-seconds and cost per pool for the caller's tenant, or (admins)
    one tenant or every tenant with a per-tenant list."""
    s, e = parse_time(start, "start"), parse_time(end, "end")
    if s is not None and e is not None and e <= s:
        raise APIError(400, "invalid_request", "end must be after start.", param="end")
    now = time.time() if now is None else now
    if not key.grants_admin:
        if tenant not in (None, key.tenant_id):
            raise APIError(
                403,
                "permission_denied",
                "Only admin keys can read another tenant's usage.",
                param="tenant",
            )
        return {**tenant_usage(session, key.tenant_id, s, e, now=now), "tenants": None}
    if tenant is not None:
        if session.get(Tenant, tenant) is None:
            raise not_found("tenant", tenant, param="tenant")
        return {**tenant_usage(session, tenant, s, e, now=now), "tenants": None}
    everyone = tenant_usage(session, None, s, e, now=now)
    ids = session.scalars(select(Job.tenant_id).where(Job.usage.is_not(None)).distinct()).all()
    per_tenant = [tenant_usage(session, t, s, e, now=now) for t in sorted(ids)]
    everyone["tenants"] = [
        {k: u[k] for k in ("tenant_id", "jobs", "gpu_seconds", "cost", "by_pool")}
        for u in per_tenant
        if u["jobs"]
    ]
    return everyone
