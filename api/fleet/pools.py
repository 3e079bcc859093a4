"""The node pools as the API shows them: their capacity now and the jobs on them.

Capacity: the scheduler's local executor builds its snapshot as the configured nodes
minus the GPUs of ``running`` jobs, packed first-fit (``CapacitySnapshot.packed`` over
its rows, ``LocalExecutor.snapshot``); this module builds the same view from the
database with the same function (``capacity_source: "config"``: GPUs *used* are exact,
GPUs *total* are what the pools file declares). In Kubernetes mode the
scheduler counts real Nodes (allocatable GPUs minus pods' requests) and publishes them
each cycle (``pool_capacity``); the API, which does not talk to the cluster, shows that
observation while it is fresh (``capacity_source: "cluster"``, with ``observed_at``).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from fastapi import FastAPI
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.fleet.usage import to_timestamp
from control.db.models import ApiKey, Job, PoolCapacity
from control.observability.collectors import set_pool_capacity_provider
from control.settings import Settings
from scheduling.capacity import CapacitySnapshot, HeldGpus
from scheduling.pools import NodePool, load_pools


def load_node_pools(settings: Settings) -> list[NodePool]:
    """The pools the scheduler uses (``TUNEFLEET_NODE_POOLS_FILE`` or the local pool)."""
    return load_pools(settings.node_pools_file)


def install(app: FastAPI, settings: Settings) -> None:
    """Load the pools into ``app.state.node_pools`` (a broken file is a start-up error,
    as for the scheduler) and give Prometheus their GPU totals."""
    pools = load_node_pools(settings)
    app.state.node_pools = pools
    totals = {p.name: p.gpus_per_node * p.nodes for p in pools}
    set_pool_capacity_provider(lambda: totals)


def capacity_snapshot(session: Session, pools: list[NodePool]) -> CapacitySnapshot:
    """Configured nodes minus what running jobs hold (the local executor's view).

    Running jobs are packed first-fit onto nodes in start order, as the local executor
    does; the DB does not record node names, only each job's pool and GPU count.
    """
    rows = session.execute(
        select(Job.id, Job.tenant_id, Job.priority, Job.pool, Job.gpus, Job.started_at)
        .where(Job.status == "running", Job.pool.in_([p.name for p in pools]))
        .order_by(Job.started_at, Job.id)
    ).all()
    return CapacitySnapshot.packed(
        pools,
        (HeldGpus(jid, tenant, int(priority or 0), pool, gpus, to_timestamp(started))
         for jid, tenant, priority, pool, gpus, started in rows),
    )


# A published cluster observation older than this is not shown (the scheduler is down or
# stuck); the pools file's view is shown instead.
OBSERVED_CAPACITY_MAX_AGE = dt.timedelta(minutes=2)


def _observed_capacity(session: Session, pools: list[NodePool]) -> dict[str, PoolCapacity]:
    """The scheduler's fresh cluster observations of ``pools``, by pool name."""
    rows = session.scalars(select(PoolCapacity).where(PoolCapacity.pool.in_([p.name for p in pools])))
    now = dt.datetime.now(dt.UTC)
    return {r.pool: r for r in rows if now - r.observed_at <= OBSERVED_CAPACITY_MAX_AGE}


def _node_view(name: str, gpus_total: int, gpus_free: int) -> dict[str, Any]:
    return {"name": name, "gpus_total": gpus_total, "gpus_used": gpus_total - gpus_free, "gpus_free": gpus_free}


def _waiting_pool(
    job_placement: dict[str, Any] | None, estimate: dict[str, Any] | None
) -> str | None:
    """The pool a queued job waits for: the one it pinned, else its estimate's choice."""
    pinned = (job_placement or {}).get("pool")
    if pinned:
        return pinned
    est = estimate or {}
    return (est.get("chosen") or {}).get("pool") or est.get("pool")


def pool_views(session: Session, pools: list[NodePool], key: ApiKey) -> list[dict[str, Any]]:
    """Every pool with its capacity now; running job ids of the caller's tenant (admins: all)."""
    snap = capacity_snapshot(session, pools)
    queued: dict[str, int] = {}
    for placement, estimate in session.execute(
        select(Job.placement, Job.estimate).where(Job.status == "queued")
    ):
        pool = _waiting_pool(placement, estimate)
        if pool:
            queued[pool] = queued.get(pool, 0) + 1
    observed = _observed_capacity(session, pools)
    out: list[dict[str, Any]] = []
    for pool in pools:
        running = sorted(
            (j for j in snap.running.values() if j.pool == pool.name),
            key=lambda j: (j.started_at, j.job_id),
        )
        visible = [j.job_id for j in running if key.grants_admin or j.tenant == key.tenant_id]
        if pool.name in observed:
            row = observed[pool.name]
            node_list = [_node_view(n["name"], n["gpus_total"], n["gpus_free"]) for n in row.nodes]
            source = {"capacity_source": "cluster", "observed_at": int(row.observed_at.timestamp())}
        else:
            node_list = [_node_view(n.name, n.gpus_total, n.gpus_free) for n in snap.nodes.get(pool.name, {}).values()]
            source = {"capacity_source": "config", "observed_at": None}
        total = sum(n["gpus_total"] for n in node_list)
        free = sum(n["gpus_free"] for n in node_list)
        out.append(
            {
                "name": pool.name,
                "accelerator": pool.accelerator,
                "gpu_memory_bytes": pool.gpu_memory_bytes,
                "gpu_memory_gib": round(pool.gpu_memory_gib, 2),
                "gpus_per_node": pool.gpus_per_node,
                "nodes": len(node_list),
                "gpus_total": total,
                "gpus_used": total - free,
                "gpus_free": free,
                "trainers": list(pool.trainers),
                "trainer_image": pool.trainer_image,
                "price_per_gpu_hour": pool.price_per_gpu_hour,
                "peak_tflops": pool.peak_tflops,
                "max_nodes_per_job": pool.max_nodes_per_job,
                "running_jobs": visible,
                "queued_jobs": queued.get(pool.name, 0),
                "node_list": node_list,
                **source,
            }
        )
    return out
