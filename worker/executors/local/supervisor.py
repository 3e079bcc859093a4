"""The body of the Celery task ``tunefleet.run_local_job``: run and supervise one trainer
on this machine (the task is registered in ``worker/tasks/jobs.py``).

Idempotent by job id and run attempt, and safe to deliver twice (``acks_late``): it does
nothing unless the job is ``running`` at the task's attempt on a local pool and no live
supervisor holds the job's lock, and it first stops a trainer orphaned by a worker that
died. The supervisor stops the trainer (SIGTERM: it checkpoints) as soon as the job is no
longer ``running`` at this attempt -- cancelled, paused, preempted, or already admitted
again. How the trainer ended becomes an ``ObservedChange`` of this attempt, and
``worker.outcomes.apply_outcome`` (the one outcome path of both executors) makes the
transition; only the outputs' manifest is registered here first, in case the trainer's
last report was lost.

A trainer that crashed (an internal error, ``kill -9``, the kernel's OOM killer) is not
restarted here: its run ends as a lost run (REQUEUE), and ``apply_outcome`` counts the
restart, requeues the job from its latest checkpoint after the restart backoff
(``TUNEFLEET_RESTART_BACKOFF_S``; the scheduler admits it as the next attempt) and fails
it past ``TUNEFLEET_MAX_RESTARTS`` -- exactly as for a Kubernetes pod that crashed.

A database that restarts under a running job costs the supervisor nothing: the checks
it makes while the trainer runs log the error and try again at the next poll, and the
final outcome is written with retries, so the trainer is never left unsupervised.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError, OperationalError

from control.artifacts import file_store
from control.db.models import Job
from control.db.session import session_scope
from control.errors import APIError
from control.inference_preload import install as install_preload
from control.jobs.lifecycle import add_event, lock_job
from control.queue import SCHEDULE, CeleryQueue
from control.reports.ingest import apply_artifacts, apply_report
from control.reports.schemas import ArtifactsItem, ReportBatchIn
from control.settings import Settings, get_settings
from scheduling.pools import load_pools
from trainers.exit_codes import ExitCode
from trainers.spec import TrainerSpec
from worker.executors.base import ObservedChange, ObservedKind, StopReason
from worker.executors.local.executor import HEARTBEAT_FILE, LOG_FILE, read_stop_reason, spec_path
from worker.executors.local.process import (
    TrainerOutcome,
    describe_exit,
    kill_orphan,
    supervise_trainer,
    supervision_lock,
)
from worker.outcomes import apply_outcome
from worker.report_gaps import TrainerOutputs
from worker.spec_builder import local_trainer_threads

log = logging.getLogger(__name__)


T = TypeVar("T")
# Transient database errors (a restart, a failover, a dropped connection).
TRANSIENT_DB_ERRORS = (OperationalError, DBAPIError)
FINISH_RETRIES = 30  # ~1 min of retries for the final write: a database restart takes seconds


def _job_state(db_url: str, job_id: str) -> tuple[str, int] | None:
    """(status, attempt) of the job, or None when it is gone."""
    with session_scope(db_url) as session:
        row = session.execute(select(Job.status, Job.attempt).where(Job.id == job_id)).first()
    return (row[0], int(row[1] or 0)) if row else None


def _tolerant(what: str, fn: Callable[[], T], fallback: T) -> T:
    """``fn()``, or ``fallback`` when the database is unreachable right now (logged)."""
    try:
        return fn()
    except TRANSIENT_DB_ERRORS as exc:
        log.warning("%s: the database is unreachable (%s); trying again at the next poll", what, type(exc).__name__)
        return fallback


def supervise_attempt(job_id: str, attempt: int | None = None) -> str:
    """Supervise the trainer of ``job_id``'s run ``attempt`` until it ends; returns the job's
    final status. ``attempt`` None (a task sent before attempts were numbered): the current one."""
    settings = get_settings()
    install_preload(settings)  # a job that succeeds here hints the inference worker to load its base
    db_url = settings.resolved_database_url
    job_dir = settings.job_dir(job_id)
    path = spec_path(settings, job_id)
    state = _job_state(db_url, job_id)
    if state is None:
        return "skipped"
    if attempt is None:
        attempt = state[1]
    if state != ("running", attempt) or not path.exists():
        # Paused, cancelled or admitted again before this task ran (its run never starts),
        # or while a worker that died supervised it (its run ends here).
        log.info("%s: the job is %s at attempt %s; the task of attempt %s has nothing to run", job_id, *state,
                 attempt)
        if _release_attempt(settings, job_id, attempt, job_dir):
            CeleryQueue(settings).send(SCHEDULE)  # the next attempt may start now
        return "skipped"
    with supervision_lock(job_dir) as mine:
        if not mine:
            log.info("%s is supervised by another worker already", job_id)
            return "skipped"
        return _supervise(settings, db_url, job_id, attempt, job_dir, path)


def _supervise(settings: Settings, db_url: str, job_id: str, attempt: int, job_dir: Path, path: Path) -> str:
    if kill_orphan(job_dir / "trainer.pid"):
        _event(db_url, job_id, "warn", "found the trainer of a worker that died; restarting it")
    spec = TrainerSpec.load(path)

    def should_stop() -> bool:
        if read_stop_reason(settings, job_id) is not None:
            return True
        state = _tolerant(f"{job_id}: status check", lambda: _job_state(db_url, job_id), ("running", attempt))
        return state is None or state != ("running", attempt)

    outcome = supervise_trainer(
        path,
        log_path=job_dir / LOG_FILE,
        termination_path=Path(spec.termination_log or job_dir / "termination.json"),
        pid_path=job_dir / "trainer.pid",
        should_stop=should_stop,
        heartbeat_path=job_dir / HEARTBEAT_FILE,
        grace_s=settings.stop_grace_s,
        env={"OMP_NUM_THREADS": str(local_trainer_threads()), "TUNEFLEET_STOP_WITH_PARENT": "1"},
    )
    if spec.report.spool_dir:
        _with_retries(f"{job_id}: spooled reports",
                      lambda: deliver_spool(settings, job_id, Path(spec.report.spool_dir), attempt=attempt))
    status = _with_retries(f"{job_id}: outcome", lambda: finish(
        settings, job_id, spec.output_dir, outcome, read_stop_reason(settings, job_id), attempt=attempt))
    CeleryQueue(settings).send(SCHEDULE)  # a slot is free again
    return status


def _with_retries(what: str, fn: Callable[[], T]) -> T:
    """``fn()``, retried every 2 s while the database is unreachable (``FINISH_RETRIES`` times)."""
    tries = 1
    while True:
        try:
            return fn()
        except TRANSIENT_DB_ERRORS as exc:
            if tries >= FINISH_RETRIES:
                raise
            log.warning("%s: the database is unreachable (%s); retry %d of %d in 2 s", what, type(exc).__name__,
                        tries, FINISH_RETRIES)
            tries += 1
            time.sleep(2.0)


def _release_attempt(settings: Settings, job_id: str, attempt: int, job_dir: Path) -> bool:
    """Record that no trainer of ``attempt`` runs, when no live supervisor watches one (a
    duplicate delivery of the task may be supervising it right now: that one records its
    own outcome). A trainer orphaned by a dead worker is stopped first; the run's end goes
    through the one outcome path like any other (``exited_attempt``, the resume point, an
    event). Returns True when recorded."""
    with supervision_lock(job_dir, wait_s=0) as mine:
        if not mine:
            return False
        orphan = kill_orphan(job_dir / "trainer.pid")
        with session_scope(settings.resolved_database_url) as session:
            job = lock_job(session, job_id)
            if job is None or attempt > (job.attempt or 0) or attempt <= (job.exited_attempt or 0):
                return False
            message = ("its supervising worker died; the worker that took over stopped its trainer" if orphan
                       else "no trainer of it runs: its supervising worker died, or it never started")
            _apply(settings, session, job, ObservedChange(
                job_id, ObservedKind.STOPPED, stop_reason=read_stop_reason(settings, job_id), message=message,
                attempt=attempt))
            return True


def _event(db_url: str, job_id: str, level: str, message: str) -> None:
    def write() -> None:
        with session_scope(db_url) as session:
            job = session.get(Job, job_id)
            if job is not None:
                add_event(session, job, message, level=level)

    _tolerant(f"{job_id}: event", write, None)


def observed_change(job_id: str, attempt: int, outcome: TrainerOutcome,
                    stop_reason: StopReason | None) -> ObservedChange:
    """How the supervised run of ``attempt`` ended, as the change both executors report."""
    code = outcome.returncode
    if outcome.stopped or code == ExitCode.PREEMPTED:
        # A stop nobody here asked for (no stop request, e.g. the worker shutting down)
        # has no reason: the job is requeued, not counted as a preemption.
        return ObservedChange(job_id, ObservedKind.STOPPED, exit_code=code, stop_reason=stop_reason,
                              message=f"trainer stopped ({_code_text(code)})", attempt=attempt)
    if outcome.succeeded:
        return ObservedChange(job_id, ObservedKind.SUCCEEDED, exit_code=code, message="trainer finished",
                              attempt=attempt)
    if outcome.crashed:
        # A lost run, as a crashed pod is for the Kubernetes executor: apply_outcome resumes
        # it from its latest checkpoint after the backoff, or fails it past max_restarts.
        error = outcome.error or {}
        detail = f": {error['message']}" if error.get("message") else ""
        return ObservedChange(job_id, ObservedKind.REQUEUE, exit_code=code,
                              error_code=error.get("code") or "trainer_crashed",
                              message=f"trainer {describe_exit(code)}{detail}", attempt=attempt)
    error = outcome.error or {"code": "trainer_failed", "message": f"the trainer ended with {_code_text(code)}"}
    return ObservedChange(job_id, ObservedKind.FAILED, exit_code=code, error_code=error["code"],
                          message=error["message"], attempt=attempt)


def _register_manifest(session, job: Job, output_dir: str) -> None:
    """Register the outputs from manifest.json (in case the trainer's last report was lost)."""
    manifest = Path(output_dir) / "manifest.json"
    if output_dir.startswith("s3://") or not manifest.exists():
        return
    files = json.loads(manifest.read_text(encoding="utf-8")).get("files", [])
    item = ArtifactsItem.model_validate({"type": "artifacts", "location": output_dir, "files": files})
    apply_artifacts(session, job, item)


def deliver_spool(settings: Settings, job_id: str, spool_dir: Path, *, attempt: int) -> int:
    """Apply the report batches the trainer left in its spool (it ended while the API was
    unreachable and gave up sending them): a batch the API applied already is a duplicate
    by its seq and changes nothing, so nothing is lost and nothing counted twice. Only
    while the job is still at this run's attempt. Returns the number of new batches."""
    applied = 0
    for path in sorted(spool_dir.glob("*.json")):
        if not path.stem.isdigit():
            continue
        try:
            batch = ReportBatchIn.model_validate_json(path.read_bytes())
        except (OSError, ValueError) as exc:
            log.warning("%s: spooled batch %s unreadable (%s); skipped", job_id, path.name, exc)
            continue
        with session_scope(settings.resolved_database_url) as session:
            job = lock_job(session, job_id)
            if job is None or (job.attempt or 0) != attempt:
                return applied
            try:
                applied += apply_report(session, job, batch, settings)
            except APIError as exc:  # the API would have refused it too (e.g. a bad location)
                log.warning("%s: spooled batch %s refused: %s", job_id, path.name, exc.message)
                continue
        path.unlink(missing_ok=True)
    if applied:
        log.info("%s: applied %d report batch(es) the trainer could not deliver", job_id, applied)
    return applied


def finish(settings: Settings, job_id: str, output_dir: str, outcome: TrainerOutcome,
           stop_reason: StopReason | None, *, attempt: int | None = None) -> str:
    """Record how the supervised run of ``attempt`` (None: the job's current one) ended;
    returns the job's status afterwards."""
    with session_scope(settings.resolved_database_url) as session:
        job = lock_job(session, job_id)
        if job is None:
            return "deleted"
        outcome = _with_reported_error(job, outcome)
        change = observed_change(job_id, job.attempt or 0 if attempt is None else attempt, outcome, stop_reason)
        if job.status == "running" and (job.attempt or 0) == change.attempt and change.kind == ObservedKind.SUCCEEDED:
            _register_manifest(session, job, output_dir)
        return _apply(settings, session, job, change)


def _apply(settings: Settings, session, job: Job, change: ObservedChange) -> str:
    """``change`` through the one outcome path, with this service's settings."""
    pools = {p.name: p for p in load_pools(settings.node_pools_file)}
    return apply_outcome(session, job, change, files=file_store(settings), pools=pools,
                         max_restarts=settings.max_restarts, now=time.time(),
                         restart_backoff=(settings.restart_backoff_s, settings.restart_backoff_max_s),
                         outputs=TrainerOutputs(settings, job.id))


def _with_reported_error(job: Job, outcome: TrainerOutcome) -> TrainerOutcome:
    """``outcome`` with the error the trainer reported to the API, when it ended on purpose
    (a user error, out of memory) but left no termination message: a full disk refuses
    that file too, while the error report still arrives (the reporter sends it from
    memory). Without this the job failed as ``trainer_failed`` instead of ``disk_full``."""
    deliberate = outcome.returncode in (ExitCode.USER_ERROR, ExitCode.OUT_OF_MEMORY)
    if outcome.error is not None or not deliberate or not (job.error or {}).get("code"):
        return outcome
    return replace(outcome, error={"code": str(job.error["code"]), "message": str(job.error.get("message", ""))})


def _code_text(returncode: int) -> str:
    if returncode < 0:
        return f"signal {-returncode}"
    try:
        return f"exit {returncode} ({ExitCode(returncode).name.lower()})"
    except ValueError:
        return f"exit {returncode}"
