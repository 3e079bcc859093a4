"""The local executor: trainers as subprocesses of this machine's Celery worker.

The embedded default (`tunefleet serve`) places jobs on the `local` pool, whose "GPUs"
are trainer slots of this machine. `launch` writes the spec into the job directory and
sends the Celery task ``tunefleet.run_local_job``; that task (worker/tasks/jobs.py)
supervises the trainer process (worker/executors/local_process.py) and writes the
outcome through the one transition function. Because the task is ``acks_late``, a
worker killed mid-run gets it again: the task then stops the orphaned trainer and
starts it anew from its latest checkpoint.

`stop` leaves a stop request in the job directory (the reason: cancel, pause, preempt);
the supervising task also stops the trainer whenever the job's status is no longer
``running``, so a cancel through the API needs nothing but the transition.
"""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy import select

from api.db.models import Job
from api.db.session import session_scope
from api.queue import RUN_LOCAL_JOB, TaskQueue
from api.settings import Settings
from scheduling.capacity import CapacitySnapshot, HeldGpus
from scheduling.pools import NodePool
from trainers.common.private_files import PRIVATE_FILE_MODE, private_dir, write_private_text
from trainers.spec import TrainerSpec
from worker.executors.base import JobRef, ObservedChange, ObservedKind, StopReason
from worker.spec_builder import write_spec

SPEC_FILE = "spec.json"
STOP_FILE = "stop_request"
LOG_FILE = "trainer.log"
HEARTBEAT_FILE = "supervisor.heartbeat"
# A supervising task touches its heartbeat several times a second; one silent this long
# has died with its worker (a broker without redelivery, e.g. the server-less one).
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
        """Re-supervise running local jobs whose supervising task died with its worker.

        Outcomes need no collecting: the supervising task writes each one itself. But a
        worker killed mid-job takes its task along on brokers that do not redeliver
        (kombu's server-less transport); a stale heartbeat tells, and the task is sent
        again (it stops the orphaned trainer and resumes from the latest checkpoint).
        """
        changes: list[ObservedChange] = []
        now = time.time()
        with session_scope(self.settings.resolved_database_url) as session:
            rows = session.execute(
                select(Job.id, Job.started_at, Job.attempt)
                .where(Job.status == "running", Job.pool.in_(list(self.pools)))
            ).all()
        for job_id, started_at, attempt in rows:
            job_dir = self.settings.job_dir(job_id)
            if not (job_dir / SPEC_FILE).exists():
                continue
            heartbeat = job_dir / HEARTBEAT_FILE
            last = heartbeat.stat().st_mtime if heartbeat.exists() else (
                started_at.timestamp() if started_at else now)
            if now - last > STALE_HEARTBEAT_S:
                heartbeat.touch(mode=PRIVATE_FILE_MODE)  # one re-send per stale period
                if self.queue.send(RUN_LOCAL_JOB, job_id, attempt):
                    changes.append(ObservedChange(
                        job_id=job_id, kind=ObservedKind.RETRYING,
                        message="the worker supervising the trainer stopped; supervising it again "
                                "(the trainer resumes from its latest checkpoint)",
                    ))
        return changes
