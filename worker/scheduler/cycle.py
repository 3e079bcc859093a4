"""The scheduling cycle (kueue-style): a short function of numbered steps.

``run_cycle`` takes these steps, numbered the same in the code's comments:

1. observe: what the executor saw since the last cycle (exits, pod problems) becomes job
   transitions;
2. snapshot: the queued jobs, the capacity snapshot (published when it came from the
   cluster) and the tenants' recent GPU-seconds;
3. plan (``plan_cycle``, pure): 3a. order the heads (priority, tenant dominant share,
   age); 3b. place each head on a working copy of the snapshot; 3c. admit it when it
   fits, consuming the working copy; 3d. otherwise it waits, with a reason and a
   position (and preempts, or holds a reservation for backfill), unless no pool could
   hold it even with every GPU free (``no_pool_fits``: the pools file changed under a
   queued job), which would wait forever: it fails, unless it asked to wait
   (``placement.queue_if_unfit``);
4. admit: the admissions' transitions are committed, then each job is launched with all
   its GPUs at once;
5. preempt: the victims get SIGTERM (checkpoint, then requeued by step 1 of a later
   cycle, resuming from the checkpoint);
6. requeue: the waiting jobs' reasons and positions are written, and the jobs no pool
   can hold fail with ``no_pool_fits`` and each pool's reason.

``plan_cycle`` is pure: (queued jobs, capacity snapshot, recent usage, clock) -> what to
admit, whom to preempt, and why everyone else waits. ``run_cycle`` does the I/O around
it through injected parts: a ``SchedulerStore`` (the DB, or memory in tests), an
``Executor`` (local processes or Kubernetes), a lock (one active scheduler) and a clock.

Backfill without starvation: the first waiting job that could run on a pool (memory-
wise) gets a *reservation* of the nodes closest to free there. Later jobs may use
reserved nodes only if they are expected to finish before the reservation is expected
to start (EASY backfilling: the head's start is never delayed by a job the estimator
knows to be longer); every other node is open to backfill.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduling.capacity import CapacitySnapshot, RunningJob
from scheduling.ordering import FairQueue, dominant_shares
from scheduling.placement import (
    Objective,
    Placement,
    PreemptionPolicy,
    candidate_pools,
    estimate_for,
    no_pool_fits,
    place_job,
    trainer_for,
)
from scheduling.reasons import WAITING, Reason
from scheduling.request import JobRequest
from worker.executors.base import Executor, JobRef, ObservedChange, StopReason

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(frozen=True)
class CycleConfig:
    """Policy knobs of a cycle (from settings)."""

    preemption: PreemptionPolicy = field(default_factory=PreemptionPolicy)
    objective: Objective = "cost"
    backfill: bool = True
    reservations_per_pool: int = 1
    fair_share_window_s: float = 7 * 24 * 3600.0
    tenant_weights: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Admission:
    job: JobRequest
    placement: Placement


@dataclass(frozen=True)
class Preemption:
    victim_id: str
    for_job: str
    pool: str


@dataclass(frozen=True)
class Waiting:
    job: JobRequest
    placement: Placement
    position: int
    reason: str


@dataclass(frozen=True)
class Unfit:
    """A queued job no pool can hold even with every GPU free (it would wait forever)."""

    job: JobRequest
    reasons: tuple[Reason, ...]

    @property
    def message(self) -> str:
        return (f"No node pool can hold this job, even with all its GPUs free "
                f"({'; '.join(r.message for r in self.reasons)}): the node pools changed since it was "
                "queued. Create it again for a pool that holds it, or with placement.queue_if_unfit "
                "to wait for a pool that is being added or grown.")


@dataclass(frozen=True)
class Admitted:
    """An admission the store wrote: what the executor launches."""

    admission: Admission
    row: JobRef
    spec: Any


@dataclass
class CyclePlan:
    admissions: list[Admission] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    waiting: list[Waiting] = field(default_factory=list)
    unfit: list[Unfit] = field(default_factory=list)
    """Jobs that fail: no pool can ever hold them (and they did not ask to wait anyway)."""
    reservations: dict[str, tuple[str, float]] = field(default_factory=dict)
    """node -> (job id holding the reservation, expected start time)."""


def _reserve(job: JobRequest, snapshot: CapacitySnapshot, blocked: Mapping[str, tuple[str, float]],
             now: float, used: Mapping[str, int], per_pool: int) -> tuple[list[str], float] | None:
    """Nodes to hold for a waiting job: in its best pool (with a reservation left), those
    closest to free."""
    candidates, _ = candidate_pools(job, snapshot)
    best = None
    for cand in candidates:
        pool, gpus = cand.pool, cand.estimate.gpus
        if used.get(pool.name, 0) >= per_pool:
            continue
        quota = pool.quota_for(job.tenant)
        if (quota is not None and not pool.quota_borrowing
                and snapshot.tenant_gpus(job.tenant, pool.name) + gpus > quota):
            continue  # waits for its own jobs to finish; holding nodes would not help
        need = max(1, gpus // pool.gpus_per_node) if gpus > pool.gpus_per_node else 1
        nodes = [n for n in snapshot.nodes.get(pool.name, {}).values() if n.name not in blocked]
        if len(nodes) < need:
            continue
        # Closest to free = most free GPUs, then the earliest expected release.
        ends: dict[str, float] = {}
        for r in snapshot.running.values():
            if r.pool == pool.name:
                end = r.expected_end if r.expected_end is not None else math.inf
                for name, _ in r.nodes:
                    ends[name] = max(ends.get(name, now), end)
        nodes.sort(key=lambda n: (-n.gpus_free, ends.get(n.name, now), n.name))
        chosen = nodes[:need]
        start = max((ends.get(n.name, now) for n in chosen), default=now)
        key = (start, cand.estimate.eta_s or 0.0)
        if best is None or key < best[0]:
            best = (key, [n.name for n in chosen], start)
    if best is None:
        return None
    return best[1], best[2]


def plan_cycle(queued: Iterable[JobRequest], snapshot: CapacitySnapshot, *, now: float,
               config: CycleConfig = CycleConfig(),
               recent_gpu_seconds: Mapping[tuple[str, str], float] | None = None) -> CyclePlan:
    """Decide one cycle. Pure: ``snapshot`` is not modified."""
    plan = CyclePlan()
    jobs = list(queued)
    # (3a) heads in order: priority, tenant dominant share, age.
    shares = dominant_shares(snapshot, recent_gpu_seconds or {}, config.fair_share_window_s,
                             {j.tenant for j in jobs}, config.tenant_weights)
    queue = FairQueue(jobs, shares, {p: snapshot.pool_total(p) for p in snapshot.pools}, config.tenant_weights)
    # The working copy of the snapshot that admissions consume.
    working = snapshot.copy()
    reserved: dict[str, tuple[str, float]] = {}  # node -> (job id, expected start)
    reservations_used: dict[str, int] = {}
    position = 0
    for job in queue:
        # (3b) place the head; reserved nodes are closed unless it ends before they start.
        blocked = frozenset(_blocked_for(job, working, reserved, now)) if reserved else frozenset()
        placement = place_job(job, working, policy=config.preemption, blocked_nodes=blocked,
                              objective=config.objective)
        if placement.mode == "fit":
            # (3c) admit: the whole gang at once.
            est = placement.estimate
            working.allocate(RunningJob(
                job_id=job.job_id, tenant=job.tenant, pool=placement.pool or "", priority=job.priority,
                started_at=now, nodes=placement.nodes, preemptible=job.preemptible,
                expected_end=(now + est.eta_s) if est and est.eta_s is not None else None))
            queue.charge(job.tenant, placement.pool or "", placement.gpus)
            plan.admissions.append(Admission(job, placement))
            continue
        # (3d) the rest wait, with a reason and a position; one no pool can ever hold fails.
        # A job some pool could hold always has a waiting reason (quota, free GPUs): only
        # the others are asked about (a busy cycle of thousands of waiting jobs stays cheap).
        if (placement.mode == "no_fit" and not job.queue_if_unfit
                and not any(r.code in WAITING for r in placement.reasons)):
            never = no_pool_fits(job, working.pools)
            if never:
                plan.unfit.append(Unfit(job, never))
                continue
        position += 1
        if placement.mode == "fit_after_preemption":
            for victim_id in placement.victims:
                working.mark_stopping(victim_id)
                plan.preemptions.append(Preemption(victim_id, job.job_id, working.running[victim_id].pool))
            for name, _ in placement.nodes:
                reserved[name] = (job.job_id, now)  # nobody backfills nodes being emptied for it
        elif config.backfill and any(reservations_used.get(p, 0) < config.reservations_per_pool
                                     for p in snapshot.pools):
            hold = _reserve(job, working, reserved, now, reservations_used, config.reservations_per_pool)
            if hold is not None:
                pool = working_pool_of(working, hold[0][0])
                reservations_used[pool] = reservations_used.get(pool, 0) + 1
                for name in hold[0]:
                    reserved[name] = (job.job_id, hold[1])
        reason = placement.reason_text()
        if placement.mode == "no_fit":
            reason = f"{reason}; position {position} in queue"
        plan.waiting.append(Waiting(job, placement, position, reason))
    plan.reservations = reserved
    return plan


def working_pool_of(snapshot: CapacitySnapshot, node: str) -> str:
    for pool, nodes in snapshot.nodes.items():
        if node in nodes:
            return pool
    return ""


def _blocked_for(job: JobRequest, snapshot: CapacitySnapshot, reserved: Mapping[str, tuple[str, float]],
                 now: float) -> set[str]:
    """Reserved nodes this job may not use: all of them unless it ends before they start."""
    blocked = set()
    etas: dict[str, float | None] = {}
    for node, (holder, start) in reserved.items():
        if holder == job.job_id:
            continue
        pool = working_pool_of(snapshot, node) if node not in etas else None
        if pool is not None and pool not in etas:
            cand = snapshot.pools.get(pool)
            trainer = trainer_for(job, cand) if cand else None
            est = estimate_for(job, cand, trainer) if cand and trainer else None
            etas[pool] = est.eta_s if est and est.fits else None
        eta = etas.get(pool) if pool is not None else None
        if eta is None or now + eta > start:
            blocked.add(node)
    return blocked


# ----------------------------------------------------------------------------------------
# I/O around the plan


class SchedulerStore(Protocol):
    """Where jobs live (the DB in the service, memory in benchmarks)."""

    def queued(self) -> list[JobRequest]: ...

    def recent_gpu_seconds(self, since: float) -> dict[tuple[str, str], float]: ...

    def admit(self, admissions: Sequence[Admission]) -> Iterable[Admitted]:
        """queued -> running for each (via the one transition function), in as few
        transactions as the store can; yields the jobs admitted, with their row and
        trainer spec, once committed, for the executor to launch.

        A job the store refuses (no longer queued, or its spec failed it) is left out and
        logged; the others are admitted."""
        ...

    def launch_failed(self, job: JobRequest, error: Exception) -> None: ...

    def preempting(self, victim_id: str, for_job: str) -> JobRef | None:
        """Record that a victim is being preempted (event); returns its row to stop."""
        ...

    def set_waiting(self, waiting: Sequence[Waiting]) -> None:
        """Write each job's queue_reason (with an event, only when it changed) and its
        position among the waiting jobs of this cycle (1 = next)."""
        ...

    def fail_unfit(self, unfit: Sequence[Unfit]) -> None:
        """queued -> failed with error ``no_pool_fits`` and ``Unfit.message``, for each job
        still queued (one cancelled meanwhile stays cancelled)."""
        ...

    def publish_capacity(self, snapshot: CapacitySnapshot) -> None:
        """Record the pools' nodes as observed in the cluster (for the API's pool view);
        called only with a snapshot that came from the cluster, not from the config."""
        ...

    def apply_observed(self, changes: list[ObservedChange]) -> None: ...


class SchedulerLock(Protocol):
    def acquire(self) -> bool: ...

    def release(self) -> None: ...


@dataclass
class CycleResult:
    ran: bool
    plan: CyclePlan | None = None
    observed: int = 0
    seconds: float = 0.0


def run_cycle(store: SchedulerStore, executor: Executor, *, clock: Clock = time.time,
              lock: SchedulerLock | None = None, config: CycleConfig = CycleConfig()) -> CycleResult:
    """One cycle with I/O: steps 1-6 of the module docstring (observe, snapshot, plan,
    admit, preempt, requeue)."""
    if lock is not None and not lock.acquire():
        return CycleResult(ran=False)
    t0 = time.perf_counter()
    try:
        # (1) observe: what happened since the last cycle (exits, pod problems) -> job transitions.
        changes = executor.reconcile()
        if changes:
            store.apply_observed(changes)
        # (2) snapshot: the queued jobs, capacity and recent usage.
        now = clock()
        queued = store.queued()
        snapshot = executor.snapshot()
        if snapshot.observed:
            store.publish_capacity(snapshot)
        usage = store.recent_gpu_seconds(now - config.fair_share_window_s)
        # (3) plan: order and place every head (pure).
        plan = plan_cycle(queued, snapshot, now=now, config=config, recent_gpu_seconds=usage)
        # (4) admit (the transitions, committed) then launch, all GPUs of a job at once.
        for done in store.admit(plan.admissions):
            try:
                executor.launch(done.row, done.spec, done.admission.placement)
            except Exception as exc:
                log.exception("launch of %s failed", done.admission.job.job_id)
                store.launch_failed(done.admission.job, exc)
        # (5) preempt: SIGTERM -> checkpoint -> requeued by apply_observed with resume_from.
        for pre in plan.preemptions:
            victim = store.preempting(pre.victim_id, pre.for_job)
            if victim is not None:
                executor.stop(victim, StopReason.PREEMPT)
        # (6) requeue the rest with their reasons and positions; fail those no pool can hold.
        store.set_waiting(plan.waiting)
        if plan.unfit:
            store.fail_unfit(plan.unfit)
        return CycleResult(ran=True, plan=plan, observed=len(changes), seconds=time.perf_counter() - t0)
    finally:
        if lock is not None:
            lock.release()
