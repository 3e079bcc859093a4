"""``LocalExecutor``: trainers as subprocesses of this machine's Celery worker.

The embedded default (`tunefleet serve`) places jobs on the `local` pool, whose "GPUs"
are trainer slots of this machine. `launch` writes the spec into the job directory and
sends the Celery task ``tunefleet.run_local_job``; that task (its body:
``worker.executors.local.supervisor``) supervises the trainer process
(``worker.executors.local.process``) and hands how the run ended to the one outcome path.
A worker killed mid-run leaves the job's supervisor lock free: `reconcile` (every
scheduling cycle) sends the task again within seconds, and the worker that runs it stops
the orphaned trainer and starts it anew from its latest checkpoint -- or, for a job
cancelled or paused meanwhile, records how the run ended.

`stop` leaves a stop request in the job directory (the reason: cancel, pause, preempt);
the supervising task also stops the trainer whenever the job's status is no longer
``running``, so a cancel through the API needs nothing but the transition.
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

from sqlalchemy import or_, select

from control.db.models import Job
from control.db.session import session_scope
from control.queue import RUN_LOCAL_JOB, TaskQueue
from control.settings import Settings
from scheduling.capacity import CapacitySnapshot, HeldGpus
from scheduling.pools import NodePool
from trainers.common.private_files import private_dir, write_private_text
from trainers.spec import TrainerSpec
from worker.executors.base import JobRef, ObservedChange, ObservedKind, StopReason
from worker.executors.local.process import supervised
from worker.spec_builder import write_spec

SPEC_FILE = "spec.json"
STOP_FILE = "stop_request"
LOG_FILE = "trainer.log"
HEARTBEAT_FILE = "supervisor.heartbeat"
# A supervising task touches its heartbeat several times a second and holds the job's
# supervisor lock: a lock nobody holds and a heartbeat silent this long mean its worker died.
ORPHAN_AFTER_S = 2.0
# A run admitted this long ago whose task never touched the heartbeat: the task was lost
# (a broker without redelivery, e.g. the server-less one, or a worker killed with it).
STALE_HEARTBEAT_S = 60.0


def spec_path(settings: Settings, job_id: str) -> Path:
    return settings.job_dir(job_id) / SPEC_FILE


def stop_path(settings: Settings, job_id: str) -> Path:
    return settings.job_dir(job_id) / STOP_FILE


def read_stop_reason(settings: Settings, job_id: str) -> StopReason | None:
    try:
        return StopReason(stop_path(settings, job_id).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


class LocalExecutor:
    """Runs trainers on this machine; implements `worker.executors.base.Executor`."""

    def __init__(self, settings: Settings, pools: list[NodePool], queue: TaskQueue) -> None:
        self.settings = settings
        self.pools = {p.name: p for p in pools}
        self.queue = queue
        self._resent: dict[str, tuple[int, float]] = {}  # job id -> (attempt, when its task was sent again)

    def launch(self, job: JobRef, spec: TrainerSpec, placement: object) -> None:
        private_dir(self.settings.job_dir(job.id))
        stop_path(self.settings, job.id).unlink(missing_ok=True)
        write_spec(spec, spec_path(self.settings, job.id))
        if not self.queue.send(RUN_LOCAL_JOB, job.id, getattr(job, "attempt", None)):
            raise RuntimeError("the task queue did not accept the trainer task")

    def stop(self, job: JobRef, reason: StopReason) -> None:
        path = stop_path(self.settings, job.id)
        private_dir(path.parent)
        write_private_text(path, reason.value)

    def snapshot(self) -> CapacitySnapshot:
        """The configured local pools, minus the slots of jobs running on them (packed onto
        the pool's nodes in start order, as the slots filled)."""
        with session_scope(self.settings.resolved_database_url) as session:
            rows = session.execute(
                select(Job.id, Job.tenant_id, Job.priority, Job.pool, Job.gpus, Job.started_at)
                .where(Job.status == "running", Job.pool.in_(list(self.pools)))
                .order_by(Job.started_at, Job.id)
            ).all()
        return CapacitySnapshot.packed(
            list(self.pools.values()),
            (HeldGpus(jid, tenant, int(priority or 0), pool, gpus, started.timestamp() if started else None)
             for jid, tenant, priority, pool, gpus, started in rows))

    def reconcile(self) -> list[ObservedChange]:
        """Send the task again for every run no supervisor watches any more.

        Outcomes need no collecting: the supervising task writes each one itself. But a
        worker killed mid-run takes its task along (Redis gives it back only after the
        broker's visibility timeout, the server-less transport never): the job's
        supervisor lock is then free while its run has no recorded end, and the task is
        sent again within ``ORPHAN_AFTER_S`` plus one cycle. For a running job it stops the
        orphaned trainer and resumes it from its latest checkpoint; for a job that left
        ``running`` meanwhile (cancelled, paused) it stops the trainer and records the
        run's end. A task lost before it ever ran is sent again after
        ``STALE_HEARTBEAT_S``.
        """
        changes: list[ObservedChange] = []
        now = time.time()
        with session_scope(self.settings.resolved_database_url) as session:
            rows = session.execute(
                select(Job.id, Job.status, Job.attempt, Job.usage, Job.started_at)
                .where(Job.pool.in_(list(self.pools)),
                       or_(Job.status == "running", Job.attempt > Job.exited_attempt))
            ).all()
        for job_id, status, attempt, usage, started_at in rows:
            if not self._orphaned(job_id, attempt, _admitted_at(usage, started_at, now), now):
                continue
            self._resent[job_id] = (attempt, now)
            if self.queue.send(RUN_LOCAL_JOB, job_id, attempt) and status == "running":
                changes.append(ObservedChange(
                    job_id=job_id, kind=ObservedKind.RETRYING,
                    message="the worker supervising the trainer stopped; supervising it again "
                            "(the trainer resumes from its latest checkpoint)",
                ))
        return changes

    def _orphaned(self, job_id: str, attempt: int, admitted: float, now: float) -> bool:
        """Whether the run of ``attempt`` has neither a supervisor nor a task sent for it lately."""
        job_dir = self.settings.job_dir(job_id)
        if not (job_dir / SPEC_FILE).exists() or supervised(job_dir):
            return False
        sent_attempt, sent_at = self._resent.get(job_id, (None, 0.0))
        if sent_attempt == attempt and now - sent_at < STALE_HEARTBEAT_S:
            return False  # sent again already; that task has yet to take the lock
        heartbeat = job_dir / HEARTBEAT_FILE
        beat = heartbeat.stat().st_mtime if heartbeat.exists() else 0.0
        if beat >= admitted:  # a supervisor of this run ran, and none holds the lock now
            return now - beat > ORPHAN_AFTER_S
        return now - admitted > STALE_HEARTBEAT_S


def _admitted_at(usage: dict | None, started_at: object, now: float) -> float:
    """When the job's current run was admitted: its usage's last segment's start."""
    segments = (usage or {}).get("segments") or []
    if segments and segments[-1].get("start") is not None:
        return float(segments[-1]["start"])
    return started_at.timestamp() if isinstance(started_at, dt.datetime) else now
