"""Queue order: priority first, then the tenant with the smallest dominant share, then age.

Fair share is dominant-resource fairness over pools: a tenant's share of a pool is the
GPUs it holds now plus its recent use (GPU-seconds over the window / window length),
divided by the pool's size; its dominant share is the largest over pools, divided by
the tenant's weight. Within one priority level the tenant with the smallest dominant
share goes next, and every admission during a cycle charges the tenant at once, so a
tenant with 1,000 queued jobs cannot crowd out one with 3.

``FairQueue`` yields heads one at a time in that order (a heap over tenants: O(log T)
per job).
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Mapping

from scheduling.capacity import CapacitySnapshot
from scheduling.request import JobRequest


def dominant_shares(snapshot: CapacitySnapshot, recent_gpu_seconds: Mapping[tuple[str, str], float],
                    window_s: float, tenants: Iterable[str],
                    weights: Mapping[str, float] | None = None) -> dict[str, float]:
    """Dominant share per tenant from held GPUs and recent GPU-seconds (per (tenant, pool))."""
    totals = {p: max(snapshot.pool_total(p), 1) for p in snapshot.pools}
    shares: dict[str, float] = {}
    for tenant in tenants:
        best = 0.0
        for pool, total in totals.items():
            held = snapshot.tenant_gpus(tenant, pool)
            recent = recent_gpu_seconds.get((tenant, pool), 0.0) / window_s if window_s > 0 else 0.0
            best = max(best, (held + recent) / total)
        shares[tenant] = best / (weights or {}).get(tenant, 1.0)
    return shares


class FairQueue:
    """Queued jobs in scheduling order, with shares that move as jobs are admitted."""

    def __init__(self, jobs: Iterable[JobRequest], shares: Mapping[str, float],
                 pool_totals: Mapping[str, int], weights: Mapping[str, float] | None = None) -> None:
        per_tenant: dict[str, list[JobRequest]] = defaultdict(list)
        for job in jobs:
            per_tenant[job.tenant].append(job)
        self._queues = {t: deque(sorted(js, key=lambda j: (-j.priority, j.created_at, j.job_id)))
                        for t, js in per_tenant.items()}
        self._shares = defaultdict(float, shares)
        self._totals = {p: max(n, 1) for p, n in pool_totals.items()}
        self._weights = weights or {}
        self._pool_use: dict[tuple[str, str], float] = defaultdict(float)
        self._heap: list[tuple[int, float, float, str, str]] = []
        for tenant in self._queues:
            self._push(tenant)

    def _push(self, tenant: str) -> None:
        q = self._queues[tenant]
        if q:
            head = q[0]
            heapq.heappush(self._heap, (-head.priority, self._shares[tenant], head.created_at, head.job_id, tenant))

    def __iter__(self) -> Iterator[JobRequest]:
        while self._heap:
            *_, tenant = heapq.heappop(self._heap)
            job = self._queues[tenant].popleft()
            yield job
            self._push(tenant)

    def charge(self, tenant: str, pool: str, gpus: int) -> None:
        """An admission during the cycle raises the tenant's share for the next pick."""
        total = self._totals.get(pool, 1)
        new = (self._shares[tenant] * self._weights.get(tenant, 1.0) + gpus / total) / self._weights.get(tenant, 1.0)
        self._shares[tenant] = max(self._shares[tenant], new)
        # The tenant's heap entry (if any) carries the old share; refresh it.
        self._heap = [(p, self._shares[t] if t == tenant else s, c, j, t) for p, s, c, j, t in self._heap]
        heapq.heapify(self._heap)

    def share(self, tenant: str) -> float:
        return self._shares[tenant]


def ordered(jobs: Iterable[JobRequest], shares: Mapping[str, float]) -> list[JobRequest]:
    """The static order (no charging): what a queue listing shows."""
    return list(FairQueue(jobs, shares, {}))
