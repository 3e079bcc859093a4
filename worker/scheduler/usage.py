"""Usage and cost accounting: GPU-seconds per job per pool, priced by the pool's rate.

A job's ``usage`` column holds the segments during which it held GPUs: a segment opens
when the scheduler admits the job (placement) and closes when the job leaves
``running`` for any reason (finished, failed, paused, preempted -- the time a preempted
job spends writing its checkpoint is included; time in the queue is not)::

    {"segments": [{"pool": "rtx4090", "gpus": 2, "start": 1764420000.0, "end": 1764423600.0,
                   "price_per_gpu_hour": 0.4}],
     "gpu_seconds": 7200.0, "cost": 0.8, "by_pool": {"rtx4090": {"gpu_seconds": 7200.0, "cost": 0.8}},
     "trainer": "fsdp_qlora"}

``tenant_usage`` sums usage per tenant and pool over a time range (segments clipped to
it) for ``GET /v1/usage``; ``recent_gpu_seconds`` feeds fair share.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session


def open_segment(usage: dict[str, Any] | None, *, pool: str, gpus: int, now: float,
                 price_per_gpu_hour: float, trainer: str | None = None) -> dict[str, Any]:
    """A copy of ``usage`` with a new open segment (idempotent if one is open)."""
    out = dict(usage or {})
    segments = [dict(s) for s in out.get("segments", [])]
    if not segments or segments[-1].get("end") is not None:
        segments.append({"pool": pool, "gpus": gpus, "start": now, "end": None,
                         "price_per_gpu_hour": price_per_gpu_hour})
    out["segments"] = segments
    if trainer:
        out["trainer"] = trainer
    return summarize(out, now)


def close_segment(usage: dict[str, Any] | None, *, now: float) -> dict[str, Any]:
    """A copy of ``usage`` with its open segment (if any) ended at ``now``."""
    out = dict(usage or {})
    segments = [dict(s) for s in out.get("segments", [])]
    if segments and segments[-1].get("end") is None:
        segments[-1]["end"] = max(now, segments[-1]["start"])
    out["segments"] = segments
    return summarize(out, now)


def _clip(seg: dict[str, Any], start: float | None, end: float | None, now: float) -> float:
    s = seg["start"] if start is None else max(seg["start"], start)
    e = seg["end"] if seg.get("end") is not None else now
    if end is not None:
        e = min(e, end)
    return max(0.0, e - s) * seg["gpus"]


def summarize(usage: dict[str, Any], now: float) -> dict[str, Any]:
    """Totals (open segments count up to ``now``)."""
    by_pool: dict[str, dict[str, float]] = defaultdict(lambda: {"gpu_seconds": 0.0, "cost": 0.0})
    for seg in usage.get("segments", []):
        gs = _clip(seg, None, None, now)
        by_pool[seg["pool"]]["gpu_seconds"] += gs
        by_pool[seg["pool"]]["cost"] += gs / 3600 * seg.get("price_per_gpu_hour", 0.0)
    out = dict(usage)
    out["by_pool"] = {p: {"gpu_seconds": round(v["gpu_seconds"], 3), "cost": round(v["cost"], 6)}
                      for p, v in by_pool.items()}
    out["gpu_seconds"] = round(sum(v["gpu_seconds"] for v in by_pool.values()), 3)
    out["cost"] = round(sum(v["cost"] for v in by_pool.values()), 6)
    return out


def _ts(value: dt.datetime | float | None) -> float | None:
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
    from api.db.models import Job

    s, e = _ts(start), _ts(end)
    q = select(Job.id, Job.usage).where(Job.usage.is_not(None))
    if tenant_id is not None:
        q = q.where(Job.tenant_id == tenant_id)
    if s is not None:
        # jobs that finished before the range cannot overlap it
        q = q.where(or_(Job.finished_at.is_(None), Job.finished_at >= dt.datetime.fromtimestamp(s, dt.UTC)))
    by_pool: dict[str, dict[str, float]] = defaultdict(lambda: {"gpu_seconds": 0.0, "cost": 0.0})
    jobs = 0
    for _, usage in session.execute(q):
        counted = False
        for seg in (usage or {}).get("segments", []):
            gs = _clip(seg, s, e, now)
            if gs > 0:
                by_pool[seg["pool"]]["gpu_seconds"] += gs
                by_pool[seg["pool"]]["cost"] += gs / 3600 * seg.get("price_per_gpu_hour", 0.0)
                counted = True
        jobs += counted
    return {
        "object": "usage", "tenant_id": tenant_id, "start": s, "end": e, "jobs": jobs,
        "gpu_seconds": round(sum(v["gpu_seconds"] for v in by_pool.values()), 3),
        "cost": round(sum(v["cost"] for v in by_pool.values()), 6),
        "by_pool": {p: {"gpu_seconds": round(v["gpu_seconds"], 3), "cost": round(v["cost"], 6)}
                    for p, v in sorted(by_pool.items())},
    }


def recent_gpu_seconds(session: Session, since: float, *, now: float) -> dict[tuple[str, str], float]:
    """GPU-seconds per (tenant, pool) since ``since`` (the fair-share window)."""
    from api.db.models import Job

    out: dict[tuple[str, str], float] = defaultdict(float)
    q = select(Job.tenant_id, Job.usage).where(Job.usage.is_not(None)).where(
        or_(Job.finished_at.is_(None), Job.finished_at >= dt.datetime.fromtimestamp(since, dt.UTC)))
    for tenant, usage in session.execute(q):
        for seg in (usage or {}).get("segments", []):
            gs = _clip(seg, since, None, now)
            if gs:
                out[(tenant, seg["pool"])] += gs
    return dict(out)
