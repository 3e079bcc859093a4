"""An in-memory ``SchedulerStore`` and ``Executor``: the cycle without a DB or a cluster.

Used by the tests of the cycle's I/O (lock, preemption flow, refused admissions). Jobs
"run" until ``finish(job_id)`` is called; capacity comes from the configured pools. The
service uses ``worker.scheduler.store`` (the DB) and a real executor.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from scheduling.capacity import CapacitySnapshot, RunningJob
from scheduling.placement import Placement
from scheduling.pools import NodePool
from scheduling.request import JobRequest
from worker.executors.base import ObservedChange, ObservedKind, StopReason
from worker.scheduler.cycle import Admission, Admitted, Unfit, Waiting

# The moves the cycle makes, as ``control.jobs.lifecycle`` allows them: admission, a failed
# launch or a preemption back to the queue, and a run's end.
TRANSITIONS = {
    "queued": {"running", "failed"},
    "running": {"queued", "succeeded", "failed"},
}


class TransitionRefused(RuntimeError):
    """A status change the lifecycle would refuse (409 in the service)."""


def transition(row: MemoryJob, to: str, event: str, **changes: Any) -> None:
    """The only writer of ``row.status``: checks the move, applies ``changes``, records
    ``event``. The caller holds the store's lock."""
    if to not in TRANSITIONS.get(row.status, set()):
        raise TransitionRefused(f"{row.id}: {row.status} -> {to} is not allowed")
    row.status = to
    for name, value in changes.items():
        setattr(row, name, value)
    row.events.append(event)


@dataclass
class MemoryJob:
    """A job row: request, status and the scheduler's notes."""

    request: JobRequest
    id: str
    status: str = "queued"
    queue_reason: str | None = None
    queue_position: int | None = None
    events: list[str] = field(default_factory=list)
    placement: Placement | None = None
    resume_from: str | None = None
    launches: int = 0


class MemoryStore:
    """Jobs in a dict; every method is thread-safe (the lock test runs two cycles)."""

    def __init__(self) -> None:
        self.jobs: dict[str, MemoryJob] = {}
        self.usage: dict[tuple[str, str], float] = {}
        self.refused: list[str] = []  # admissions refused: the job was no longer queued
        self._lock = threading.Lock()

    def submit(self, req: JobRequest) -> MemoryJob:
        with self._lock:
            job = MemoryJob(req, req.job_id)
            self.jobs[req.job_id] = job
            return job

    def queued(self) -> list[JobRequest]:
        with self._lock:
            return [j.request for j in self.jobs.values() if j.status == "queued"]

    def recent_gpu_seconds(self, since: float) -> dict[tuple[str, str], float]:
        return dict(self.usage)

    def admit(self, admissions: Sequence[Admission]) -> list[Admitted]:
        out = []
        with self._lock:
            for adm in admissions:
                row = self.jobs[adm.job.job_id]
                if row.status != "queued":  # the transition function would refuse this (409)
                    self.refused.append(adm.job.job_id)
                    continue
                transition(row, "running", f"admitted on {adm.placement.pool} ({adm.placement.gpus} GPUs)",
                           placement=adm.placement, queue_reason=None, queue_position=None)
                out.append(Admitted(adm, row, {"job_id": row.id, "resume_from": row.resume_from}))
        return out

    def launch_failed(self, job: JobRequest, error: Exception) -> None:
        with self._lock:
            transition(self.jobs[job.job_id], "queued", f"launch failed: {error}")

    def preempting(self, victim_id: str, for_job: str) -> MemoryJob | None:
        with self._lock:
            row = self.jobs.get(victim_id)
            if row is None or row.status != "running":
                return None
            row.events.append(f"preempted for {for_job}")
            return row

    def set_waiting(self, waiting: Sequence[Waiting]) -> None:
        with self._lock:
            for w in waiting:
                row = self.jobs[w.job.job_id]
                row.queue_position = w.position
                if row.queue_reason != w.reason:
                    row.queue_reason = w.reason
                    row.events.append(w.reason)

    def fail_unfit(self, unfit: Sequence[Unfit]) -> None:
        with self._lock:
            for item in unfit:
                row = self.jobs[item.job.job_id]
                if row.status == "queued":
                    transition(row, "failed", item.message, queue_reason=None, queue_position=None)

    def apply_observed(self, changes: list[ObservedChange]) -> None:
        with self._lock:
            for ch in changes:
                row = self.jobs[ch.job_id]
                if ch.kind == ObservedKind.STOPPED and ch.stop_reason == StopReason.PREEMPT:
                    transition(row, "queued", f"requeued from {ch.checkpoint}", resume_from=ch.checkpoint)
                elif ch.kind == ObservedKind.SUCCEEDED:
                    transition(row, "succeeded", "the trainer finished")
                elif ch.kind == ObservedKind.FAILED:
                    transition(row, "failed", ch.message or "the trainer failed")


class MemoryExecutor:
    """Holds GPUs for launched jobs until ``finish``/``stop``; records every call."""

    def __init__(self, pools: list[NodePool], clock=lambda: 0.0) -> None:
        self.pools = pools
        self.clock = clock
        self.running: dict[str, RunningJob] = {}
        self.launched: list[str] = []
        self.stopped: list[tuple[str, StopReason]] = []
        self._changes: list[ObservedChange] = []
        self._lock = threading.Lock()
        self.snapshot_hook = None  # tests: called inside snapshot() to force interleavings

    def launch(self, job: Any, spec: Any, placement: Placement) -> None:
        with self._lock:
            if job.id in self.running:
                return  # idempotent
            req = job.request
            self.launched.append(job.id)
            self.running[job.id] = RunningJob(
                job.id, req.tenant, placement.pool or "", req.priority, self.clock(), placement.nodes,
                preemptible=req.preemptible,
                expected_end=(self.clock() + placement.estimate.eta_s)
                if placement.estimate and placement.estimate.eta_s is not None else None)

    def stop(self, job: Any, reason: StopReason) -> None:
        with self._lock:
            self.stopped.append((job.id, reason))
            if job.id in self.running:
                self.running[job.id] = replace(self.running[job.id], stopping=True)

    def exit_stopped(self, job_id: str, checkpoint: str = "ckpt") -> None:
        """The stopped trainer wrote its checkpoint and exited (PREEMPTED)."""
        with self._lock:
            self.running.pop(job_id, None)
            self._changes.append(ObservedChange(job_id, ObservedKind.STOPPED, stop_reason=StopReason.PREEMPT,
                                                checkpoint=checkpoint, exit_code=12))

    def finish(self, job_id: str) -> None:
        with self._lock:
            self.running.pop(job_id, None)
            self._changes.append(ObservedChange(job_id, ObservedKind.SUCCEEDED, exit_code=0))

    def snapshot(self) -> CapacitySnapshot:
        with self._lock:
            snap = CapacitySnapshot.from_pools_and_running(self.pools, list(self.running.values()))
        if self.snapshot_hook:
            self.snapshot_hook()
        return snap

    def reconcile(self) -> list[ObservedChange]:
        with self._lock:
            out, self._changes = self._changes, []
            return out
