"""Celery task ``tunefleet.run_local_job``: run and supervise one trainer on this machine.

Idempotent by job id and safe to deliver twice (``acks_late``): it does nothing unless
the job is ``running`` on a local pool and no live supervisor holds the job's lock, and
it first stops a trainer orphaned by a worker that died. The outcome of the trainer becomes one transition:

=========================  =====================================================
trainer outcome            job
=========================  =====================================================
SUCCESS                    succeeded (artifacts registered from the manifest, the
                           metrics stored as its ``result_files`` CSV)
USER_ERROR / OUT_OF_MEMORY failed with the trainer's error code and message; out of
                           GPU memory on a GPU count the scheduler chose: queued
                           for the pool's next larger gang (``requeue_after_oom``)
crashed too often          failed with ``trainer_crashed``
stopped (cancel)           cancelled (already, by the API)
stopped (pause)            paused, resume_from = the latest checkpoint
stopped (preempt)          queued, resume_from = the latest checkpoint
=========================  =====================================================
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import select

from api.artifacts import ArtifactStore, file_store
from api.db.models import Job
from api.db.session import session_scope
from api.files import create_result_file
from api.lifecycle import add_event, lock_job, transition
from api.queue import SCHEDULE, CeleryQueue
from api.reports import apply_artifacts
from api.schemas.reports import ArtifactsItem
from api.settings import get_settings
from scheduling.pools import NodePool, load_pools
from trainers.exit_codes import ExitCode
from trainers.spec import TrainerSpec
from worker.celery_app import app
from worker.executors.base import StopReason
from worker.executors.local import HEARTBEAT_FILE, LOG_FILE, read_stop_reason, spec_path
from worker.executors.local_process import kill_orphan, supervise_trainer, supervision_lock
from worker.scheduler.store import requeue_after_oom, resume_point
from worker.spec_builder import local_trainer_threads

log = logging.getLogger(__name__)


def _job_status(db_url: str, job_id: str) -> str | None:
    with session_scope(db_url) as session:
        return session.scalar(select(Job.status).where(Job.id == job_id))


@app.task(name="tunefleet.run_local_job", acks_late=True, reject_on_worker_lost=True)
def run_local_job(job_id: str) -> str:
    """Supervise the trainer of ``job_id`` until it ends; returns the job's final status."""
    settings = get_settings()
    db_url = settings.resolved_database_url
    job_dir = settings.job_dir(job_id)
    path = spec_path(settings, job_id)
    if _job_status(db_url, job_id) != "running" or not path.exists():
        return "skipped"
    with supervision_lock(job_dir) as mine:
        if not mine:
            log.info("%s is supervised by another worker already", job_id)
            return "skipped"
        return _supervise(settings, db_url, job_id, job_dir, path)


def _supervise(settings, db_url: str, job_id: str, job_dir: Path, path: Path) -> str:
    if kill_orphan(job_dir / "trainer.pid"):
        _event(db_url, job_id, "warn", "found the trainer of a worker that died; restarting it")
    spec = TrainerSpec.load(path)

    def should_stop() -> bool:
        return read_stop_reason(settings, job_id) is not None or _job_status(db_url, job_id) != "running"

    def on_event(level: str, message: str) -> None:
        _event(db_url, job_id, level, message)

    def on_restart(attempt: int) -> None:
        with session_scope(db_url) as session:
            job = lock_job(session, job_id)
            if job is not None:
                job.restarts = (job.restarts or 0) + 1

    outcome = supervise_trainer(
        path,
        log_path=job_dir / LOG_FILE,
        termination_path=Path(spec.termination_log or job_dir / "termination.json"),
        pid_path=job_dir / "trainer.pid",
        should_stop=should_stop,
        heartbeat_path=job_dir / HEARTBEAT_FILE,
        on_event=on_event,
        on_restart=on_restart,
        max_restarts=settings.max_restarts,
        grace_s=settings.stop_grace_s,
        env={"OMP_NUM_THREADS": str(local_trainer_threads()), "TUNEFLEET_STOP_WITH_PARENT": "1"},
    )
    status = _finish(db_url, job_id, spec, outcome, read_stop_reason(settings, job_id),
                     files=file_store(settings), pools=load_pools(settings.node_pools_file),
                     max_restarts=settings.max_restarts)
    CeleryQueue(settings).send(SCHEDULE)  # a slot is free again
    return status


def _event(db_url: str, job_id: str, level: str, message: str) -> None:
    with session_scope(db_url) as session:
        job = session.get(Job, job_id)
        if job is not None:
            add_event(session, job, message, level=level)


def _register_manifest(session, job: Job, output_dir: str) -> None:
    """Register the outputs from manifest.json (in case the trainer's last report was lost)."""
    manifest = Path(output_dir) / "manifest.json"
    if output_dir.startswith("s3://") or not manifest.exists():
        return
    files = json.loads(manifest.read_text(encoding="utf-8")).get("files", [])
    item = ArtifactsItem.model_validate({"type": "artifacts", "location": output_dir, "files": files})
    apply_artifacts(session, job, item)


def _finish(db_url: str, job_id: str, spec: TrainerSpec, outcome, stop_reason: StopReason | None,
            *, files: ArtifactStore, pools: Sequence[NodePool] = (), max_restarts: int = 0) -> str:
    with session_scope(db_url) as session:
        job = lock_job(session, job_id)
        if job is None:
            return "deleted"
        if job.status != "running":
            # Cancelled or paused through the API (or preempted by the scheduler): the
            # transition happened already; the trainer is gone and its checkpoint kept.
            add_event(session, job, f"trainer stopped ({_code_text(outcome.returncode)})")
            return job.status
        if outcome.stopped or outcome.returncode == ExitCode.PREEMPTED:
            resume = resume_point(session, job)
            if stop_reason == StopReason.PAUSE:
                transition(session, job, "paused", actor="system", resume_from=resume,
                           message="Job paused; it resumes from its last checkpoint.")
            elif stop_reason == StopReason.CANCEL:
                transition(session, job, "cancelled", actor="system", message="Job cancelled.")
            else:
                transition(session, job, "queued", actor="executor", resume_from=resume,
                           message="Job preempted; requeued to resume from its last checkpoint.")
            return job.status
        if outcome.succeeded:
            _register_manifest(session, job, spec.output_dir)
            results = create_result_file(session, job, store=files)
            transition(session, job, "succeeded", actor="executor", result_files=[results.id],
                       message="Job succeeded: the adapter is ready.")
            return job.status
        error = outcome.error or {"code": "trainer_failed",
                                  "message": f"the trainer ended with {_code_text(outcome.returncode)}"}
        pool = next((p for p in pools if p.name == job.pool), None)
        if outcome.returncode == ExitCode.OUT_OF_MEMORY and requeue_after_oom(
                session, job, pool, max_restarts=max_restarts, reason=error["message"]):
            return job.status
        transition(session, job, "failed", actor="executor", level="error",
                   message=f"Job failed: {error['code']}: {error['message']}",
                   error={"code": error["code"], "message": error["message"], "param": None})
        return job.status


def _code_text(returncode: int) -> str:
    if returncode < 0:
        return f"signal {-returncode}"
    try:
        return f"exit {returncode} ({ExitCode(returncode).name.lower()})"
    except ValueError:
        return f"exit {returncode}"
