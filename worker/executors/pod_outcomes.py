"""What a launched trainer's Kubernetes objects say about its run: a pure function.

``observe(run, job, pods, now, max_pending_s=...)`` reads one launch's batch/v1 Job and
its pods (as the informers cached them) and returns the ``ObservedChange`` values they
imply, each naming the job's run attempt it belongs to (``TrackedRun.run``). It does no I/O and keeps no state, so
every pod state is one row of a table-driven test; the executor (``kubernetes.py``)
decides what to do with the objects (delete a lost Job) and the store turns the
changes into job transitions (``worker.outcomes.apply_outcome``).

=================================  ==========================================================
observed                           change
=================================  ==========================================================
pod Running                        STARTED
Job suspended, no pods yet         WAITING "admitted, waiting for Kueue (LocalQueue X)"
Job suspended again after it       REQUEUE ``preempted_by_kueue`` (not a restart)
started, its pods gone
Pending, PodScheduled=False        WAITING (the scheduler's message); REQUEUE
                                   ``unschedulable`` after ``max_pending_s``
ImagePullBackOff / ErrImagePull    FAILED ``image_pull_failed``
container OOMKilled                FAILED ``out_of_memory`` (host memory)
pod Evicted / node lost            REQUEUE (from its last checkpoint)
exit 0 on every pod                SUCCEEDED
exit 10 / 11                       FAILED with the trainer's termination message
exit 12                            STOPPED after a stop -- else REQUEUE
                                   ``preempted_by_cluster`` (e.g. a node drain), or
                                   ``preempted_by_kueue`` when Kueue suspended the Job
several pods failed                the one that finished first, else the first not exit 12
                                   (the Job controller then stopped the gang's other pods)
Job Failed, DeadlineExceeded       FAILED ``max_runtime_exceeded`` (activeDeadlineSeconds)
Job Failed, no failed pod visible  FAILED with the Job's message (podFailurePolicy FailJob)
                                   -- else REQUEUE ``trainer_crashed``
other exit codes / signals         STOPPED after a stop (killed past the grace period) --
                                   else REQUEUE ``trainer_crashed``
Job and pods gone                  STOPPED after a stop -- else REQUEUE ``job_lost``
=================================  ==========================================================
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from kube import kueue
from kube.labels import completion_index
from trainers.exit_codes import ExitCode
from worker.executors.base import ObservedChange, ObservedKind, StopReason

# Pod-level reasons for a run lost through no fault of the trainer -> requeue.
POD_LOST = {"Evicted": "was evicted", "NodeLost": "lost its node", "Preempting": "was preempted by the cluster",
            "Terminated": "was terminated"}
# Exit codes the Job's podFailurePolicy fails it on (worker.executors.manifests), by error code.
FAIL_JOB_CODES = {ExitCode.USER_ERROR: "user_error", ExitCode.OUT_OF_MEMORY: "out_of_memory"}
IMAGE_ERRORS = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"}
# A Job whose pods never appeared is "lost" only after this long: the informers may not
# have shown a just-created Job's pods yet.
LOST_AFTER_S = 5.0


@dataclass
class TrackedRun:
    """What the executor knows about one launch of a job."""

    job_id: str
    pool: str
    tenant: str
    priority: int
    nodes: tuple[tuple[str, int], ...]
    launched_at: float
    stop_reason: StopReason | None = None
    reported: set[str] = field(default_factory=set)
    done: bool = False
    attempt: int | None = None
    """The launch (``tunefleet.io/attempt``) observed; None: whichever exists."""
    run: int | None = None
    """The job's run attempt (``jobs.attempt``) the launch belongs to; None: unknown (a
    launch from before runs were numbered), read as the current one."""


def observe(run: TrackedRun, job: Any, pods: list[Any], now: float, *,
            max_pending_s: float) -> list[ObservedChange]:
    """The changes that ``job`` (the launch's batch/v1 Job, or None when it is gone) and
    its ``pods`` show for ``run`` at time ``now`` (see the module's table).

    A terminal change (SUCCEEDED, FAILED, STOPPED, REQUEUE) is returned alone.
    """
    return [replace(ch, attempt=run.run) for ch in _observe(run, job, pods, now, max_pending_s)]


def _observe(run: TrackedRun, job: Any, pods: list[Any], now: float, max_pending_s: float) -> list[ObservedChange]:
    jid = run.job_id
    out: list[ObservedChange] = []
    failed_cond = _failed_condition(job)
    if failed_cond is not None and failed_cond.reason == "DeadlineExceeded" and run.stop_reason is None:
        # Kubernetes SIGTERMs the pods: their exit 12 must not read as a cluster preemption.
        deadline = job.spec.active_deadline_seconds if job.spec else None
        return [ObservedChange(jid, ObservedKind.FAILED, error_code="max_runtime_exceeded", message=(
            f"the trainer ran longer than the {deadline or '?'} s a job may run "
            "(TUNEFLEET_K8S_TRAINER_MAX_RUNTIME_S); its last checkpoint is kept"))]
    terminated = []
    for pod in sorted(pods, key=completion_index):
        st = pod.status
        cs = (st.container_statuses or [None])[0] if st else None
        waiting = cs.state.waiting if cs and cs.state else None
        if waiting and waiting.reason in IMAGE_ERRORS:
            image = pod.spec.containers[0].image
            return [ObservedChange(jid, ObservedKind.FAILED, error_code="image_pull_failed", message=(
                f"the trainer image {image} could not be pulled ({waiting.reason}): {waiting.message or ''}".strip()
                + "; check the pool's trainer_image and the registry credentials"))]
        if st and st.reason in POD_LOST:
            return [ObservedChange(jid, ObservedKind.REQUEUE, error_code=snake_case(st.reason),
                                   message=f"pod {pod.metadata.name} {POD_LOST[st.reason]}: {st.message or ''}"
                                   .strip() + "; requeued from its last checkpoint")]
        term = cs.state.terminated if cs and cs.state else None
        if term is not None:
            terminated.append((pod, term))
        if st and st.phase == "Pending" and not pod.spec.node_name:
            cond = next((c for c in st.conditions or [] if c.type == "PodScheduled" and c.status == "False"), None)
            if cond is not None:
                if now - run.launched_at > max_pending_s:
                    return [ObservedChange(jid, ObservedKind.REQUEUE, error_code="unschedulable", message=(
                        f"pods could not be scheduled for {max_pending_s:.0f} s ({cond.message}); requeued"))]
                out.append(ObservedChange(jid, ObservedKind.WAITING, message=f"pod pending: {cond.message}"))
    failed = [(p, term) for p, term in terminated if term.exit_code != 0]
    if failed:
        # The failure that came first is the cause (the Job controller then stops the rest
        # of the gang, which exit 12); within one second, the one that is not exit 12.
        pod, term = min(failed, key=lambda f: (f[1].finished_at.timestamp() if f[1].finished_at else math.inf,
                                               f[1].exit_code == ExitCode.PREEMPTED))
        if term.exit_code == ExitCode.PREEMPTED and run.stop_reason is None and _suspended(job):
            return [ObservedChange(jid, ObservedKind.REQUEUE, exit_code=term.exit_code,
                                   error_code="preempted_by_kueue", message=(
                                       "Kueue suspended the Job (its quota went to other workloads); "
                                       "requeued from its checkpoint"))]
        return [exit_change(run, pod, term)]
    if failed_cond is not None and run.stop_reason is None:
        if failed_cond.reason == "PodFailurePolicy":
            # e.g. "Container trainer for pod ns/p failed with exit code 10 matching FailJob rule at index 1"
            found = re.search(r"exit code (\d+)", failed_cond.message or "")
            code = int(found.group(1)) if found else None
            return [ObservedChange(jid, ObservedKind.FAILED, exit_code=code,
                                   error_code=FAIL_JOB_CODES.get(code, "trainer_failed"),
                                   message=f"the trainer Job failed: {failed_cond.message or failed_cond.reason}")]
        return [ObservedChange(jid, ObservedKind.REQUEUE, error_code="trainer_crashed", message=(
            f"the trainer Job failed ({failed_cond.reason}: {failed_cond.message or ''}".strip() + "); requeued"))]
    n_pods = (job.spec.completions or 1) if job is not None else len(pods)
    if terminated and len(terminated) >= n_pods or (job is not None and job_condition(job) == "Complete"):
        return [ObservedChange(jid, ObservedKind.SUCCEEDED, exit_code=0, message="trainer finished")]
    if job is None and not pods and now - run.launched_at > LOST_AFTER_S:
        if run.stop_reason is not None:
            # Deleting the Job removes its pods; the watch may never have shown the
            # pod's terminated state, so the exit code is unknown here.
            return [ObservedChange(jid, ObservedKind.STOPPED, stop_reason=run.stop_reason,
                                   message=f"stopped ({run.stop_reason.value}); its pods are gone")]
        return [ObservedChange(jid, ObservedKind.REQUEUE, error_code="job_lost",
                               message="the Kubernetes Job disappeared; requeued")]
    if _suspended(job) and not pods:
        if job.status is not None and job.status.start_time is not None and run.stop_reason is None:
            # It ran and Kueue suspended it again, and its pods are gone without our
            # having seen their exit (the pod objects were removed first): the trainer
            # had its SIGTERM grace to checkpoint, like any preemption.
            return [ObservedChange(jid, ObservedKind.REQUEUE, error_code="preempted_by_kueue", message=(
                "Kueue suspended the Job (its quota went to other workloads) and its pods are gone; "
                "requeued from its checkpoint"))]
        queue = (job.metadata.labels or {}).get(kueue.QUEUE_LABEL, "?") if job.metadata else "?"
        out.append(ObservedChange(jid, ObservedKind.WAITING,
                                  message=f"admitted, waiting for Kueue (LocalQueue {queue})"))
    if any(p.status and p.status.phase == "Running" for p in pods):
        out.append(ObservedChange(jid, ObservedKind.STARTED, message="trainer running"))
    return out


def exit_change(run: TrackedRun, pod: Any, term: Any) -> ObservedChange:
    """The change a terminated trainer container means (``term``: its terminated state)."""
    jid, code = run.job_id, term.exit_code
    error = termination_error(term.message)
    where = f"pod {pod.metadata.name}"
    if term.reason == "OOMKilled":
        return ObservedChange(jid, ObservedKind.FAILED, exit_code=code, error_code="out_of_memory", message=(
            f"{where} was OOM-killed (host memory limit); use a smaller micro_batch_size or max_seq_len"))
    if code == ExitCode.USER_ERROR:
        return ObservedChange(jid, ObservedKind.FAILED, exit_code=code,
                              error_code=error.get("code", "user_error"),
                              message=error.get("message", f"{where}: the trainer reported a user error"))
    if code == ExitCode.OUT_OF_MEMORY:
        return ObservedChange(jid, ObservedKind.FAILED, exit_code=code, error_code=error.get("code", "out_of_memory"),
                              message=error.get("message", f"{where}: the GPU ran out of memory"))
    if code == ExitCode.PREEMPTED:
        if run.stop_reason is not None:
            return ObservedChange(jid, ObservedKind.STOPPED, exit_code=code, stop_reason=run.stop_reason,
                                  message=f"trainer checkpointed and stopped ({run.stop_reason.value})")
        return ObservedChange(jid, ObservedKind.REQUEUE, exit_code=code, error_code="preempted_by_cluster",
                              message=f"{where} received SIGTERM from the cluster; requeued from its checkpoint")
    if run.stop_reason is not None:  # killed after the grace period while stopping
        return ObservedChange(jid, ObservedKind.STOPPED, exit_code=code, stop_reason=run.stop_reason,
                              message=f"trainer stopped ({run.stop_reason.value}) with exit code {code}")
    return ObservedChange(jid, ObservedKind.REQUEUE, exit_code=code, error_code=error.get("code", "trainer_crashed"),
                          message=error.get("message") or f"{where} exited with code {code} ({term.reason})")


def job_condition(job: Any) -> str | None:
    """``Complete`` or ``Failed`` once the batch/v1 Job has finished, else None."""
    for cond in (job.status.conditions or []) if job.status else []:
        if cond.status == "True" and cond.type in ("Complete", "Failed"):
            return cond.type
    return None


def _suspended(job: Any) -> bool:
    """Whether the batch/v1 Job is suspended (Kueue evicted it, or has not admitted it yet)."""
    return bool(job is not None and job.spec is not None and job.spec.suspend)


def _failed_condition(job: Any) -> Any:
    """The batch/v1 Job's ``Failed`` condition once it is true, else None."""
    for cond in (job.status.conditions or []) if job is not None and job.status else []:
        if cond.type == "Failed" and cond.status == "True":
            return cond
    return None


def termination_error(message: str | None) -> dict[str, str]:
    """``{"code", "message"}`` from the trainer's termination message (its last JSON line)."""
    if not message:
        return {}
    try:
        data = json.loads(message.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"message": message.strip()[-500:]}
    return {k: str(v) for k, v in data.items() if k in ("code", "message")} if isinstance(data, dict) else {}


def snake_case(text: str) -> str:
    """``NodeLost`` -> ``node_lost`` (pod reasons as error codes)."""
    return "".join("_" + ch.lower() if ch.isupper() else ch for ch in text).lstrip("_")
