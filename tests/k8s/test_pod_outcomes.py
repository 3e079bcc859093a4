"""``observe``: one row per pod state, built from the official client's own models."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from kubernetes import client

from worker.executors.base import ObservedKind, StopReason
from worker.executors.pod_outcomes import TrackedRun, observe

LAUNCHED = 1_000.0
MAX_PENDING_S = 900.0


def run(stop: StopReason | None = None, attempt: int | None = 3) -> TrackedRun:
    return TrackedRun("ftjob-1", "rtx4090", "org-1", 50, (("node-0", 1),), LAUNCHED, stop_reason=stop,
                      attempt=1, run=attempt)


def job(completions: int = 1, condition: str | None = None, reason: str | None = None,
        message: str | None = None, suspend: bool | None = None, started: bool = False) -> client.V1Job:
    conditions = ([client.V1JobCondition(type=condition, status="True", reason=reason, message=message)]
                  if condition else None)
    return client.V1Job(metadata=client.V1ObjectMeta(name="tf-ftjob-1-3"),
                        spec=client.V1JobSpec(completions=completions, template=client.V1PodTemplateSpec(),
                                              active_deadline_seconds=3600, suspend=suspend),
                        status=client.V1JobStatus(conditions=conditions, start_time=(
                            dt.datetime(2026, 1, 1, tzinfo=dt.UTC) if started else None)))


def pod(index: int = 0, *, phase: str = "Running", node: str | None = "node-0", reason: str | None = None,
        message: str | None = None, waiting: str | None = None, exit_code: int | None = None,
        term_reason: str | None = None, term_message: str | None = None,
        unschedulable: str | None = None, finished: int | None = None) -> client.V1Pod:
    state = None
    if waiting is not None:
        state = client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason=waiting, message="back-off"))
    elif exit_code is not None:
        state = client.V1ContainerState(terminated=client.V1ContainerStateTerminated(
            exit_code=exit_code, reason=term_reason or ("Completed" if exit_code == 0 else "Error"),
            message=term_message,
            finished_at=None if finished is None else dt.datetime.fromtimestamp(LAUNCHED + finished, dt.UTC)))
    elif phase == "Running":
        state = client.V1ContainerState(running=client.V1ContainerStateRunning())
    statuses = [client.V1ContainerStatus(name="trainer", image="reg/trainer:1", image_id="", ready=phase == "Running",
                                         restart_count=0, state=state)] if state else None
    conditions = ([client.V1PodCondition(type="PodScheduled", status="False", message=unschedulable)]
                  if unschedulable else None)
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=f"tf-ftjob-1-3-{index}",
                                     annotations={"batch.kubernetes.io/job-completion-index": str(index)}),
        spec=client.V1PodSpec(node_name=node, containers=[client.V1Container(name="trainer", image="reg/trainer:1")]),
        status=client.V1PodStatus(phase=phase, reason=reason, message=message, container_statuses=statuses,
                                  conditions=conditions))


USER_ERROR_LOG = json.dumps({"code": "nan_loss", "message": "the loss became NaN at step 7"})
GPU_OOM_LOG = json.dumps({"code": "out_of_memory", "message": "CUDA out of memory at step 1"})

# (id, tracked run, Job, pods, seconds since launch, expected [(kind, error_code, stop_reason)])
ROWS = [
    ("running", run(), job(), [pod()], 10, [(ObservedKind.STARTED, None, None)]),
    ("pending unschedulable", run(), job(), [pod(phase="Pending", node=None, unschedulable="0/3 nodes have GPUs")],
     10, [(ObservedKind.WAITING, None, None)]),
    ("pending past the limit", run(), job(), [pod(phase="Pending", node=None, unschedulable="0/3 nodes")],
     MAX_PENDING_S + 1, [(ObservedKind.REQUEUE, "unschedulable", None)]),
    ("image pull back-off", run(), job(), [pod(phase="Pending", waiting="ImagePullBackOff")], 10,
     [(ObservedKind.FAILED, "image_pull_failed", None)]),
    ("err image pull", run(), job(), [pod(phase="Pending", waiting="ErrImagePull")], 10,
     [(ObservedKind.FAILED, "image_pull_failed", None)]),
    ("host OOM-killed", run(), job(), [pod(phase="Failed", exit_code=137, term_reason="OOMKilled")], 10,
     [(ObservedKind.FAILED, "out_of_memory", None)]),
    ("evicted", run(), job(), [pod(phase="Failed", reason="Evicted", message="low on memory")], 10,
     [(ObservedKind.REQUEUE, "evicted", None)]),
    ("node lost", run(), job(), [pod(phase="Unknown", reason="NodeLost")], 10,
     [(ObservedKind.REQUEUE, "node_lost", None)]),
    ("exit 0 on every pod", run(), job(2), [pod(0, phase="Succeeded", exit_code=0),
                                            pod(1, phase="Succeeded", exit_code=0)], 10,
     [(ObservedKind.SUCCEEDED, None, None)]),
    ("exit 0 on one pod of two", run(), job(2), [pod(0, phase="Succeeded", exit_code=0), pod(1)], 10,
     [(ObservedKind.STARTED, None, None)]),
    ("job complete", run(), job(condition="Complete"), [], 10, [(ObservedKind.SUCCEEDED, None, None)]),
    ("exit 10 user error", run(), job(), [pod(phase="Failed", exit_code=10, term_message=USER_ERROR_LOG)], 10,
     [(ObservedKind.FAILED, "nan_loss", None)]),
    ("exit 11 GPU out of memory", run(), job(), [pod(phase="Failed", exit_code=11, term_message=GPU_OOM_LOG)], 10,
     [(ObservedKind.FAILED, "out_of_memory", None)]),
    ("exit 12 after our stop", run(StopReason.PAUSE), job(), [pod(phase="Failed", exit_code=12)], 10,
     [(ObservedKind.STOPPED, None, StopReason.PAUSE)]),
    ("exit 12 from the cluster", run(), job(), [pod(phase="Failed", exit_code=12)], 10,
     [(ObservedKind.REQUEUE, "preempted_by_cluster", None)]),
    ("killed past the grace period", run(StopReason.CANCEL), job(), [pod(phase="Failed", exit_code=137)], 10,
     [(ObservedKind.STOPPED, None, StopReason.CANCEL)]),
    ("crash", run(), job(), [pod(phase="Failed", exit_code=1)], 10, [(ObservedKind.REQUEUE, "trainer_crashed", None)]),
    # The Job's podFailurePolicy stops the gang at its first failure: the others' exit 12
    # is the SIGTERM that brought them, whatever rank failed first.
    ("user error of rank 1, rank 0 stopped", run(), job(2, "Failed", "PodFailurePolicy"),
     [pod(0, phase="Failed", exit_code=12), pod(1, phase="Failed", exit_code=10, term_message=USER_ERROR_LOG)],
     10, [(ObservedKind.FAILED, "nan_loss", None)]),
    ("a drain of rank 0 first, then rank 1's collective broke", run(), job(2),
     [pod(0, phase="Failed", exit_code=12, finished=5), pod(1, phase="Failed", exit_code=1, finished=9)],
     10, [(ObservedKind.REQUEUE, "preempted_by_cluster", None)]),
    ("rank 1 crashed first, then the Job stopped rank 0", run(), job(2, "Failed", "BackoffLimitExceeded"),
     [pod(0, phase="Failed", exit_code=12, finished=9), pod(1, phase="Failed", exit_code=1, finished=5)],
     10, [(ObservedKind.REQUEUE, "trainer_crashed", None)]),
    ("FailJob, its pods gone", run(), job(condition="Failed", reason="PodFailurePolicy", message=(
        "Container trainer for pod ns/tf-ftjob-1-3-0 failed with exit code 11 matching FailJob rule at index 2")),
     [], 10, [(ObservedKind.FAILED, "out_of_memory", None)]),
    ("Job failed otherwise, its pods gone", run(), job(condition="Failed", reason="BackoffLimitExceeded"), [], 10,
     [(ObservedKind.REQUEUE, "trainer_crashed", None)]),
    ("past activeDeadlineSeconds", run(), job(condition="Failed", reason="DeadlineExceeded"),
     [pod(phase="Failed", exit_code=12)], 10, [(ObservedKind.FAILED, "max_runtime_exceeded", None)]),
    ("past the deadline while we stop it", run(StopReason.CANCEL), job(condition="Failed", reason="DeadlineExceeded"),
     [pod(phase="Failed", exit_code=12)], 10, [(ObservedKind.STOPPED, None, StopReason.CANCEL)]),
    ("disrupted pod, Ignored by the Job, replaced", run(), job(),
     [pod(0, phase="Failed", exit_code=12), pod(0, phase="Pending", node=None, unschedulable="0/3 nodes")], 10,
     [(ObservedKind.REQUEUE, "preempted_by_cluster", None)]),
    ("Kueue suspended the running Job", run(), job(suspend=True), [pod(phase="Failed", exit_code=12)], 10,
     [(ObservedKind.REQUEUE, "preempted_by_kueue", None)]),
    ("suspended, not admitted by Kueue yet", run(), job(suspend=True), [], 10, [(ObservedKind.WAITING, None, None)]),
    ("Kueue suspended the running Job, its pods gone unseen", run(), job(suspend=True, started=True), [], 10,
     [(ObservedKind.REQUEUE, "preempted_by_kueue", None)]),
    ("suspended again while its trainer checkpoints", run(), job(suspend=True, started=True),
     [pod(phase="Running")], 10, [(ObservedKind.STARTED, None, None)]),
    ("gone after our stop", run(StopReason.PREEMPT), None, [], 10, [(ObservedKind.STOPPED, None, StopReason.PREEMPT)]),
    ("gone without a stop", run(), None, [], 10, [(ObservedKind.REQUEUE, "job_lost", None)]),
    ("not listed yet", run(), None, [], 1, []),
]


@pytest.mark.parametrize(("tracked", "k8s_job", "pods", "age", "expected"),
                         [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_observe(tracked, k8s_job, pods, age, expected):
    changes = observe(tracked, k8s_job, pods, LAUNCHED + age, max_pending_s=MAX_PENDING_S)
    assert [(ch.kind, ch.error_code, ch.stop_reason) for ch in changes] == expected
    assert all(ch.job_id == "ftjob-1" and ch.attempt == 3 for ch in changes)


def test_the_trainer_message_reaches_the_change():
    [change] = observe(run(), job(), [pod(phase="Failed", exit_code=10, term_message=USER_ERROR_LOG)],
                       LAUNCHED + 10, max_pending_s=MAX_PENDING_S)
    assert change.message == "the loss became NaN at step 7"
    assert change.exit_code == 10


def test_a_run_of_unknown_attempt_says_so():
    [change] = observe(run(attempt=None), job(), [pod()], LAUNCHED, max_pending_s=MAX_PENDING_S)
    assert change.attempt is None


def test_a_job_kueue_has_not_admitted_says_which_local_queue_holds_it():
    held = job(suspend=True)
    held.metadata.labels = {"kueue.x-k8s.io/queue-name": "gpu-jobs"}
    [change] = observe(run(), held, [], LAUNCHED + 10, max_pending_s=MAX_PENDING_S)
    assert change.message == "admitted, waiting for Kueue (LocalQueue gpu-jobs)"
