"""Usage and cost accounting: GPU-seconds per job per pool, priced by the pool's rate.

A job's ``usage`` column holds the segments during which it held GPUs: a segment opens
when the scheduler admits the job (placement) and closes when the job leaves
``running`` for any reason (finished, failed, paused, preempted -- the time a preempted
job spends writing its checkpoint is included; time in the queue is not)::

    {"segments": [{"pool": "rtx4090", "gpus": 2, "start": 1764420000.0, "end": 1764423600.0,
                   "price_per_gpu_hour": 0.4}],
     "gpu_seconds": 7200.0, "cost": 0.8, "by_pool": {"rtx4090": {"gpu_seconds": 7200.0, "cost": 0.8}},
     "trainer": "fsdp_qlora"}

This module is the arithmetic only, over the ``usage`` values themselves: the API's
``GET /v1/usage`` (``api.fleet.usage``) sums them per pool over a time range with
``sum_usage``, the scheduler's fair share (``worker.scheduler.store``) per (tenant, pool)
since the window start with ``gpu_seconds_since``; each reads its rows with its own
query.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any


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


def pending_segment(usage: dict[str, Any] | None, *, pool: str, gpus: int, price_per_gpu_hour: float,
                    trainer: str | None = None) -> dict[str, Any]:
    """A copy of ``usage`` with a segment that opens when the run really starts
    (``start_pending``): a job admitted onto a pool whose cluster still has to start it
    (Kueue) holds no GPUs until then, and is billed none."""
    out = dict(usage or {})
    out["pending_segment"] = {"pool": pool, "gpus": gpus, "price_per_gpu_hour": price_per_gpu_hour}
    if trainer:
        out["trainer"] = trainer
    return out


def start_pending(usage: dict[str, Any] | None, *, now: float) -> dict[str, Any]:
    """A copy of ``usage`` with its pending segment (if any) opened at ``now``."""
    out = dict(usage or {})
    pending = out.pop("pending_segment", None)
    return open_segment(out, now=now, **pending) if pending else out


def drop_pending(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """``usage`` without its pending segment: the run it was for never started."""
    if not usage or "pending_segment" not in usage:
        return usage
    return {k: v for k, v in usage.items() if k != "pending_segment"}


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
    return {**usage, **_totals(by_pool)}


def _totals(by_pool: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Rounded totals and per-pool sums (pools in the order they were first seen)."""
    return {
        "by_pool": {p: {"gpu_seconds": round(v["gpu_seconds"], 3), "cost": round(v["cost"], 6)}
                    for p, v in by_pool.items()},
        "gpu_seconds": round(sum(v["gpu_seconds"] for v in by_pool.values()), 3),
        "cost": round(sum(v["cost"] for v in by_pool.values()), 6),
    }


def sum_usage(usages: Iterable[dict[str, Any] | None], start: float | None, end: float | None,
              *, now: float) -> dict[str, Any]:
    """GPU-seconds and cost per pool of many jobs' ``usage`` within [start, end).

    Segments are clipped to the range (None: unbounded; open segments count up to
    ``now``). Returns ``{"jobs", "gpu_seconds", "cost", "by_pool": {pool: {"gpu_seconds",
    "cost"}}}``, where ``jobs`` counts the jobs with GPU time inside the range.
    """
    by_pool: dict[str, dict[str, float]] = defaultdict(lambda: {"gpu_seconds": 0.0, "cost": 0.0})
    jobs = 0
    for usage in usages:
        counted = False
        for seg in (usage or {}).get("segments", []):
            gs = _clip(seg, start, end, now)
            if gs > 0:
                by_pool[seg["pool"]]["gpu_seconds"] += gs
                by_pool[seg["pool"]]["cost"] += gs / 3600 * seg.get("price_per_gpu_hour", 0.0)
                counted = True
        jobs += counted
    return {"jobs": jobs, **_totals(dict(sorted(by_pool.items())))}


def gpu_seconds_since(rows: Iterable[tuple[str, dict[str, Any] | None]], since: float,
                      *, now: float) -> dict[tuple[str, str], float]:
    """GPU-seconds per (tenant, pool) since ``since`` from (tenant, usage) rows (the
    fair-share window)."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for tenant, usage in rows:
        for seg in (usage or {}).get("segments", []):
            gs = _clip(seg, since, None, now)
            if gs:
                out[(tenant, seg["pool"])] += gs
    return dict(out)
