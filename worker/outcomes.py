"""One path from "the trainer stopped" to a job transition, for every executor.

Both executors observe how a run ended in their own way -- the local task from the
trainer process's exit (``worker.executors.local.supervisor``), the Kubernetes executor from pods
(``worker.executors.pod_outcomes.observe``) -- and both hand the result, an
``ObservedChange``, to ``apply_outcome``, which is the only place that decides what
happens to the job:

=================  ==============================================================
outcome            job (when it is still ``running`` at the outcome's attempt)
=================  ==============================================================
STARTED            of a job admitted while Kueue held its launch: running (so is
                   any outcome of a trainer that ran, with an exit code)
SUCCEEDED          succeeded, the metrics stored as its ``result_files`` CSV
FAILED             failed with the trainer's code; out of GPU memory on a GPU count
                   the scheduler chose: queued for the pool's next larger gang
STOPPED            pause -> paused, cancel -> cancelled, preempt (or a stop nobody
                   here asked for, e.g. a worker shutdown) -> queued; each resumes
                   from the latest checkpoint
REQUEUE            queued from the latest checkpoint, one restart more; failed past
                   ``max_restarts`` -- but a preemption by the cluster (the trainer
                   checkpointed on its SIGTERM: a node drain, Kueue) counts none
=================  ==============================================================

Every terminal outcome closes the job's open usage segment and records that the run of
its attempt has stopped (``jobs.exited_attempt``): the scheduler does not start the next
attempt of a job while an older one may still write its checkpoints. First, what the
run's reports never delivered is read back from its trainer's outputs
(``worker.report_gaps``): a job resumes from the checkpoint its trainer really wrote last,
and never succeeds with holes in its records unannounced (``jobs.report_gaps``). An outcome of an
attempt older than the job's current one never moves the job: after a pause and an
immediate resume, the old run's exit must not end the new run (it used to mark it
succeeded with a quarter of its steps).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from typing import Any

from control.artifacts import ArtifactStore
from control.db.models import Job
from control.files.results import create_result_file
from control.jobs.checkpoints import latest_checkpoint
from control.jobs.lifecycle import add_event, start_admitted_launch, transition
from scheduling.estimator import candidate_gpu_counts
from scheduling.pools import NodePool
from scheduling.usage import close_segment
from trainers.exit_codes import ExitCode
from worker.executors.base import ObservedChange, ObservedKind, StopReason, restart_delay_s
from worker.report_gaps import TrainerOutputs, fill_report_gaps

log = logging.getLogger(__name__)

# REQUEUE codes of a run the cluster took back after the trainer checkpointed on its SIGTERM
# (worker.executors.pod_outcomes).
CLUSTER_PREEMPTIONS = frozenset({"preempted_by_cluster", "preempted_by_kueue"})
TERMINAL_KINDS = frozenset({ObservedKind.SUCCEEDED, ObservedKind.FAILED, ObservedKind.STOPPED, ObservedKind.REQUEUE})


def apply_outcome(session: Any, job: Job, outcome: ObservedChange, *, files: ArtifactStore,
                  pools: Mapping[str, NodePool], max_restarts: int, now: float,
                  restart_backoff: tuple[float, float] = (0.0, 0.0),
                  outputs: TrainerOutputs | None = None) -> str:
    """Turn ``outcome`` into the job's next state (see the module docstring).

    Args:
        session: a session holding ``job`` locked (``control.jobs.lifecycle.lock_job``); the caller commits.
        job: the job the outcome is about.
        outcome: what the executor observed; ``outcome.attempt`` None means the current attempt.
        files: the artifact store (the result CSV of a succeeded job is written there).
        pools: the node pools by name (an out-of-memory requeue needs the job's pool).
        max_restarts: lost runs a job may restart from its checkpoint before it fails.
        now: the time (seconds since the epoch) the run's usage segment ends.
        restart_backoff: (base, cap) seconds of ``restart_delay_s``: a requeued lost run is
            admitted again no earlier than that (``jobs.restart_not_before``).
        outputs: the job's trainer outputs, to fill what its reports lack from; None: not read.

    Returns:
        The job's status afterwards.
    """
    attempt = job.attempt or 0
    stale = outcome.attempt is not None and outcome.attempt != attempt
    awaiting = job.status == "queued" and job.awaiting_start_since is not None
    if awaiting and not stale and (outcome.kind == ObservedKind.STARTED or (
            outcome.kind in TERMINAL_KINDS and outcome.exit_code is not None)):
        # Kueue let the admitted launch run (a trainer that exited ran, even if its pod
        # was never seen Running): the job runs from now.
        start_admitted_launch(session, job, actor="executor")
        awaiting = False
        if outcome.kind == ObservedKind.STARTED:
            return job.status
    if outcome.kind not in TERMINAL_KINDS:
        if not stale and not (awaiting and outcome.message == job.queue_reason):
            add_event(session, job, outcome.message or outcome.kind.value,
                      level="info" if outcome.kind == ObservedKind.STARTED else "warn")
        return job.status
    if stale:
        job.exited_attempt = max(job.exited_attempt or 0, outcome.attempt or 0)
        add_event(session, job,
                  f"The run of attempt {outcome.attempt} stopped ({outcome.message or outcome.kind.value});"
                  f" the job is at attempt {attempt} now, so this changes nothing.")
        return job.status
    job.exited_attempt = max(job.exited_attempt or 0, attempt)
    if outputs is not None:
        succeeding = outcome.kind == ObservedKind.SUCCEEDED and (job.status == "running" or awaiting)
        fill_report_gaps(session, job, outputs, succeeded=succeeding)
    if job.status != "running" and not awaiting:
        return _after_stop(session, job, outcome, now)
    usage = close_segment(job.usage, now=now)
    if outcome.kind == ObservedKind.SUCCEEDED:
        results = create_result_file(session, job, store=files)
        transition(session, job, "succeeded", actor="executor", usage=usage, result_files=[results.id],
                   message="Job succeeded: the adapter is ready.")
    elif outcome.kind == ObservedKind.FAILED:
        if outcome.exit_code == ExitCode.OUT_OF_MEMORY and requeue_after_oom(
                session, job, pools.get(job.pool or ""), max_restarts=max_restarts, reason=outcome.message,
                usage=usage):
            return job.status
        code = outcome.error_code or "trainer_failed"
        transition(session, job, "failed", actor="executor", level="error", usage=usage,
                   message=f"Job failed: {code}: {outcome.message}",
                   error={"code": code, "message": outcome.message, "param": None})
    elif outcome.kind == ObservedKind.STOPPED:
        _stopped(session, job, outcome, usage)
    elif outcome.error_code in CLUSTER_PREEMPTIONS:  # like our own preemption: not a lost run
        resume = resume_point(session, job)
        transition(session, job, "queued", actor="executor", level="warn", usage=usage, resume_from=resume,
                   message=f"{outcome.message}; resumes from {resume or 'the start'} (not counted as a restart).")
    else:  # REQUEUE: the run was lost through no fault of the job
        restarts = job.restarts or 0
        if restarts >= max_restarts:
            code = outcome.error_code or "trainer_crashed"
            gave_up = f"gave up after {restarts} restarts"
            transition(session, job, "failed", actor="executor", level="error", usage=usage,
                       message=f"Job failed: {code}: {outcome.message} ({gave_up})",
                       error={"code": code, "message": f"{outcome.message} ({gave_up}, the most allowed: "
                                                       f"max_restarts={max_restarts})", "param": None})
        else:
            resume = resume_point(session, job)
            delay = restart_delay_s(restarts + 1, base_s=restart_backoff[0], max_s=restart_backoff[1])
            after = f" in {delay:g} s" if delay else ""
            transition(session, job, "queued", actor="executor", level="warn", usage=usage, resume_from=resume,
                       restarts=restarts + 1,
                       restart_not_before=dt.datetime.fromtimestamp(now + delay, dt.UTC) if delay else None,
                       message=f"{outcome.message} (restart {restarts + 1} of {max_restarts}); "
                               f"resumes from {resume or 'the start'}{after}.")
    return job.status


def _stopped(session: Any, job: Job, outcome: ObservedChange, usage: dict[str, Any]) -> None:
    resume = outcome.checkpoint or resume_point(session, job)
    if outcome.stop_reason == StopReason.PAUSE:
        transition(session, job, "paused", actor="system", usage=usage, resume_from=resume,
                   message="Job paused; it resumes from its last checkpoint.")
    elif outcome.stop_reason == StopReason.CANCEL:
        transition(session, job, "cancelled", actor="system", usage=usage, message="Job cancelled.")
    elif outcome.stop_reason == StopReason.PREEMPT:
        transition(session, job, "queued", actor="scheduler", usage=usage, resume_from=resume,
                   message=f"Preempted and requeued; resumes from {resume or 'the start'}.")
    else:
        transition(session, job, "queued", actor="executor", level="warn", usage=usage, resume_from=resume,
                   message=f"The trainer was stopped from outside ({outcome.message or 'SIGTERM'}); requeued, "
                           f"resumes from {resume or 'the start'}.")


def _after_stop(session: Any, job: Job, outcome: ObservedChange, now: float) -> str:
    """The run ended after the API (cancel, pause) or a report had already moved the job."""
    if job.usage:
        job.usage = close_segment(job.usage, now=now)
    message = f"The trainer stopped ({outcome.message or outcome.kind.value})"
    if job.status in ("paused", "queued"):
        # Resume from where this run really stopped: its final checkpoint was written
        # after the job left ``running`` (a pause, then a resume before the run ended).
        resume = resume_point(session, job)
        if resume != job.resume_from:
            message += f"; the job resumes from {resume or 'the start'}"
        job.resume_from = resume
    add_event(session, job, f"{message}.")
    return job.status


def resume_point(session: Any, job: Job) -> str | None:
    """Where a requeued or paused run resumes: its latest checkpoint, else where it resumed from."""
    row = latest_checkpoint(session, job)
    return row.location if row else job.resume_from


def requeue_after_oom(session: Any, job: Job, pool: NodePool | None, *, max_restarts: int, reason: str,
                      **changes: Any) -> bool:
    """Requeue a job whose trainer ran out of GPU memory on the next larger gang of its pool.

    The GPU count was the estimator's guess (the user pinned none), so running out of
    memory is the estimate's error, not the job's: the job resumes from its latest
    checkpoint on the pool's next valid GPU count (``retry_placement``), as
    ``bench/sim_trace.py`` models it. Not on CPU pools (more host devices share the same
    RAM), not past ``max_restarts``, not when the pool has no larger gang. Returns False
    when it does not apply; the caller then fails the job.
    """
    if pool is None or pool.is_cpu or job.gpus is None or (job.placement or {}).get("gpus"):
        return False
    bigger = [n for n in candidate_gpu_counts(pool) if n > job.gpus]
    if not bigger or (job.restarts or 0) >= max_restarts:
        return False
    resume = resume_point(session, job)
    transition(session, job, "queued", actor="executor", level="warn", resume_from=resume,
               restarts=(job.restarts or 0) + 1, retry_placement={"pool": pool.name, "gpus": bigger[0]},
               message=(f"Out of GPU memory on {job.gpus}x {pool.accelerator} ({reason}); requeued for "
                        f"{bigger[0]} GPUs of pool {pool.name}, resuming from {resume or 'the start'} "
                        f"(restart {(job.restarts or 0) + 1} of {max_restarts})."),
               **changes)
    return True
