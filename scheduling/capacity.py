"""Capacity snapshot: what the cluster holds right now, as plain values.

The scheduling cycle takes one snapshot per cycle (step 2) and every placement decision
is a pure function of (job, snapshot). Executors produce snapshots: the local executor
from the configured pools, the Kubernetes executor from Nodes (allocatable GPUs per pool
label) minus the GPU requests of running Pods. The cycle then applies each admission to
*its working copy* (``copy()`` then ``allocate``), so later heads see the capacity that
earlier admissions consumed.

Two indexes keep a cycle over thousands of jobs fast: nodes bucketed by free GPU count
per pool (a gang lookup costs O(GPUs per node), not O(nodes)), and GPUs held per
(tenant, pool) for quotas and fair share.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduling.pools import NodePool


@dataclass(frozen=True)
class NodeCapacity:
    """One node of a pool: how many GPUs it has and how many are not requested by pods."""

    name: str
    pool: str
    gpus_total: int
    gpus_free: int


@dataclass(frozen=True)
class RunningJob:
    """A job that holds GPUs now (a possible preemption victim, and fair-share input)."""

    job_id: str
    tenant: str
    pool: str
    priority: int
    started_at: float
    nodes: tuple[tuple[str, int], ...]
    """(node name, GPUs on that node) for every node the job's gang holds."""
    preemptible: bool = True
    expected_end: float | None = None
    """started_at + the estimator's ETA, when known (lets backfill respect reservations)."""
    stopping: bool = False
    """Told to stop (preempted/paused/cancelled) and not exited yet: its GPUs are about to
    be free, and it must not be chosen as a victim again."""

    @property
    def gpus(self) -> int:
        return sum(n for _, n in self.nodes)


@dataclass(frozen=True)
class HeldGpus:
    """A running job as the database records it: its pool and GPU count, no node names
    (the executors call it ``worker.executors.base.RunningRow``)."""

    id: str
    tenant_id: str
    priority: int
    pool: str | None
    gpus: int | None
    started_at: float | None


@dataclass
class CapacitySnapshot:
    """Pools, their nodes, and the jobs that hold GPUs on them.

    ``nodes`` maps pool name -> {node name -> NodeCapacity}; change it only through
    ``add_node``/``allocate``/``release`` so the indexes stay right.
    """

    pools: dict[str, NodePool] = field(default_factory=dict)
    nodes: dict[str, dict[str, NodeCapacity]] = field(default_factory=dict)
    running: dict[str, RunningJob] = field(default_factory=dict)
    # True when the nodes were observed in the cluster (Kubernetes Nodes minus pods'
    # requests), False when they come from the pools file (local executor, simulations).
    observed: bool = False
    # pool -> free GPU count -> ordered set (dict) of node names
    _by_free: dict[str, dict[int, dict[str, None]]] = field(default_factory=dict, repr=False)
    _tenant_gpus: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int), repr=False)
    _free: dict[str, int] = field(default_factory=lambda: defaultdict(int), repr=False)
    # priorities of running jobs that may be preempted, and how many are stopping, per pool
    _victim_priorities: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter), repr=False)
    _stopping: Counter = field(default_factory=Counter, repr=False)

    # --- construction ---------------------------------------------------------------
    @classmethod
    def from_pools(cls, pools: list[NodePool]) -> CapacitySnapshot:
        """All nodes of the configured pools, empty (local mode and simulations)."""
        snap = cls(pools={p.name: p for p in pools})
        for p in pools:
            snap.nodes.setdefault(p.name, {})
            for i in range(p.nodes):
                snap.add_node(NodeCapacity(f"{p.name}-{i}", p.name, p.gpus_per_node, p.gpus_per_node))
        return snap

    @classmethod
    def packed(cls, pools: list[NodePool], running: Iterable[HeldGpus]) -> CapacitySnapshot:
        """Configured nodes minus the GPUs that ``running`` jobs hold, packed first-fit.

        For a view built from database rows, which record each running job's pool and
        GPU count but not its nodes: jobs are packed onto the pool's nodes in the order
        given (callers pass start order, as the local executor fills its slots). Jobs of
        pools not in ``pools`` are skipped.
        """
        snap = cls.from_pools(pools)
        for row in running:
            if row.pool not in snap.nodes:
                continue
            need = max(1, row.gpus or 1)
            held: list[tuple[str, int]] = []
            for name, node in snap.nodes[row.pool].items():
                take = min(node.gpus_free, need)
                if take:
                    held.append((name, take))
                    need -= take
                if not need:
                    break
            if held:
                snap.allocate(RunningJob(
                    job_id=row.id, tenant=row.tenant_id, pool=row.pool, priority=int(row.priority or 0),
                    started_at=row.started_at or 0.0, nodes=tuple(held)))
        return snap

    @classmethod
    def from_pools_and_running(cls, pools: list[NodePool], running: list[RunningJob]) -> CapacitySnapshot:
        """Configured pools minus what ``running`` jobs hold (the local executor's view)."""
        snap = cls.from_pools(pools)
        for job in running:
            if job.pool in snap.nodes:
                snap.allocate(job, strict=False)
        return snap

    def add_node(self, node: NodeCapacity) -> None:
        self.nodes.setdefault(node.pool, {})[node.name] = node
        self._by_free.setdefault(node.pool, {}).setdefault(node.gpus_free, {})[node.name] = None
        self._free[node.pool] += node.gpus_free

    def add_running(self, job: RunningJob) -> None:
        """Record a job whose GPUs are already subtracted from node capacity (Kubernetes
        snapshots compute free GPUs from pod requests)."""
        self.running[job.job_id] = job
        self._tenant_gpus[(job.tenant, job.pool)] += job.gpus
        self._index_running(job, +1)

    def _index_running(self, job: RunningJob, sign: int) -> None:
        if job.stopping:
            self._stopping[job.pool] += sign
        elif job.preemptible:
            self._victim_priorities[job.pool][job.priority] += sign
            if self._victim_priorities[job.pool][job.priority] <= 0:
                del self._victim_priorities[job.pool][job.priority]

    def mark_stopping(self, job_id: str) -> None:
        """The job was told to stop: not a victim any more, its GPUs free up soon."""
        job = self.running[job_id]
        if not job.stopping:
            self._index_running(job, -1)
            self.running[job_id] = job = replace(job, stopping=True)
            self._index_running(job, +1)

    def lowest_victim_priority(self, pool: str) -> int | None:
        """Lowest priority among preemptible, not-stopping jobs in ``pool`` (None: none)."""
        prios = self._victim_priorities.get(pool)
        return min(prios) if prios else None

    def stopping_count(self, pool: str) -> int:
        return self._stopping.get(pool, 0)

    def copy(self) -> CapacitySnapshot:
        return CapacitySnapshot(
            pools=self.pools,
            nodes={pool: dict(ns) for pool, ns in self.nodes.items()},
            running=dict(self.running),
            observed=self.observed,
            _by_free={p: {k: dict(v) for k, v in b.items()} for p, b in self._by_free.items()},
            _tenant_gpus=defaultdict(int, self._tenant_gpus),
            _free=defaultdict(int, self._free),
            _victim_priorities=defaultdict(Counter, {p: Counter(c) for p, c in self._victim_priorities.items()}),
            _stopping=Counter(self._stopping),
        )

    # --- queries --------------------------------------------------------------------
    def pool_total(self, pool: str) -> int:
        return sum(n.gpus_total for n in self.nodes.get(pool, {}).values())

    def pool_free(self, pool: str) -> int:
        return self._free.get(pool, 0)

    def tenant_gpus(self, tenant: str, pool: str) -> int:
        """GPUs a tenant holds in a pool (for quotas and fair share)."""
        return self._tenant_gpus.get((tenant, pool), 0)

    def nodes_with_free(self, pool: str, gpus_free: int) -> dict[str, None]:
        """Names of the pool's nodes with exactly ``gpus_free`` free GPUs (insertion order)."""
        return self._by_free.get(pool, {}).get(gpus_free, {})

    # --- changes --------------------------------------------------------------------
    def _set_free(self, pool: str, name: str, free: int) -> None:
        node = self.nodes[pool][name]
        buckets = self._by_free[pool]
        del buckets[node.gpus_free][name]
        buckets.setdefault(free, {})[name] = None
        self._free[pool] += free - node.gpus_free
        self.nodes[pool][name] = NodeCapacity(node.name, node.pool, node.gpus_total, free)

    def allocate(self, job: RunningJob, *, strict: bool = True) -> None:
        """Record an admission: take the job's GPUs off its nodes."""
        pool_nodes = self.nodes[job.pool]
        for name, gpus in job.nodes:
            if name not in pool_nodes:
                if strict:
                    raise ValueError(f"node {name} is not in pool {job.pool}")
                continue
            node = pool_nodes[name]
            if gpus > node.gpus_free and strict:
                raise ValueError(f"node {name} has {node.gpus_free} free GPUs, {gpus} requested")
            self._set_free(job.pool, name, max(0, node.gpus_free - gpus))
        self.add_running(job)

    def release(self, job_id: str) -> RunningJob:
        """Record that a job gave its GPUs back (finished or preempted)."""
        job = self.running.pop(job_id)
        self._tenant_gpus[(job.tenant, job.pool)] -= job.gpus
        self._index_running(job, -1)
        pool_nodes = self.nodes.get(job.pool, {})
        for name, gpus in job.nodes:
            if name in pool_nodes:
                node = pool_nodes[name]
                self._set_free(job.pool, name, min(node.gpus_total, node.gpus_free + gpus))
        return job
