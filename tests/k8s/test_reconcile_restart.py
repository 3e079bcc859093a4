"""The scheduler's executor matched against the database, on the fake cluster.

A new ``KubernetesExecutor`` in the same test is a restarted scheduler (every Helm upgrade
recreates it): it must adopt the running jobs the previous process launched, keep the
reason of a stop that process issued, report a job whose Job vanished meanwhile, and stop
the Job of a job cancelled through the API (which does not talk to the cluster).
The DB-backed tests run the real cycle (``run_cycle`` with ``DbStore``) on the test
database, so the outcome is the job's status, restarts and events, per the store's policy.
"""

import sys
import time
from pathlib import Path

import pytest
from kubernetes import client
from sqlalchemy import select

from control.db.models import Job, JobEvent
from control.db.session import session_scope
from kube.labels import ANNOTATION_STOP_REASON
from scheduling.placement import Placement
from tests.api.conftest import make_job, processed_file, upload  # noqa: F401 (fixtures)
from tests.k8s.conftest import NAMESPACE
from tests.k8s.test_kubernetes_executor import Row, kinds, spec, until
from tests.worker.builders import rtx4090
from tests.worker.test_db_store import _tiny_config
from worker.executors.base import ObservedKind, StopReason
from worker.executors.kubernetes import KubernetesExecutor
from worker.executors.manifests import SPEC_FILE, ManifestOptions
from worker.scheduler.cycle import run_cycle
from worker.scheduler.store import DbStore, RunningRow

FAKE_TRAINER = str(Path(__file__).with_name("fake_trainer.py"))
JOBS = "/v1/fine_tuning/jobs"

_open: list[KubernetesExecutor] = []


@pytest.fixture(autouse=True)
def _close_executors():
    yield
    while _open:
        _open.pop().close()


def scheduler_process(api, running_jobs, *, job_statuses=None, mode="sleep", stop_delay_s=0.0,
                      orphan_grace_s=1.0) -> KubernetesExecutor:
    """The executor one scheduler process builds (background informers, as in the service)."""
    ex = KubernetesExecutor(
        api.api_client(), [rtx4090(2)], options=ManifestOptions(namespace=NAMESPACE, termination_grace_period_s=10),
        command=[sys.executable, FAKE_TRAINER, "--spec", SPEC_FILE], watch_timeout_s=1, running_jobs=running_jobs,
        job_statuses=job_statuses, orphan_grace_s=orphan_grace_s,
        extra_env={"FAKE_TRAINER_MODE": mode, "FAKE_TRAINER_STOP_DELAY_S": str(stop_delay_s)})
    ex.start()
    _open.append(ex)
    return ex


def restart(ex: KubernetesExecutor) -> None:
    """The old scheduler process ends (its informers stop; what it tracked is lost)."""
    ex.close()
    _open.remove(ex)


def running(job_id: str) -> RunningRow:
    return RunningRow(job_id, "org-1", 50, "rtx4090", 1, time.time())


def launch_and_start(api, ex, job_id):
    ex.launch(Row(job_id), spec(job_id), Placement("fit", pool="rtx4090", gpus=1, nodes=(("rtx4090-0", 1),),
                                                   trainer="fsdp_qlora"))
    until(api, ex, lambda s: ObservedKind.STARTED in kinds(s))
    api.wait_for(lambda: job_id in ex.logs(job_id))  # the trainer is up (its SIGTERM handler set)


# --- the executor alone: the database is a list of running rows ----------------------


def test_a_stop_issued_before_a_restart_keeps_its_reason(fake_api):
    """Preempted by the old process, the trainer is still checkpointing when the new one
    starts: its exit 12 is the preemption, not a SIGTERM from the cluster."""
    old = scheduler_process(fake_api, lambda: [running("ftjob-Pre")], stop_delay_s=2.0)
    launch_and_start(fake_api, old, "ftjob-Pre")
    old.stop(Row("ftjob-Pre"), StopReason.PREEMPT)
    restart(old)
    (job,) = client.BatchV1Api(fake_api.api_client()).list_namespaced_job(NAMESPACE).items
    assert job.metadata.annotations[ANNOTATION_STOP_REASON] == "preempt" and job.metadata.deletion_timestamp

    new = scheduler_process(fake_api, lambda: [running("ftjob-Pre")])
    seen = until(fake_api, new, lambda s: any(k != ObservedKind.STARTED for k in kinds(s)))
    end = [c for c in seen if c.kind != ObservedKind.STARTED]
    assert [(c.kind, c.stop_reason) for c in end] == [(ObservedKind.STOPPED, StopReason.PREEMPT)], end


def test_a_job_running_in_the_database_without_its_kubernetes_job_is_reported_lost(fake_api):
    ex = scheduler_process(fake_api, lambda: [running("ftjob-Gone")])
    (lost,) = until(fake_api, ex, lambda s: ObservedKind.REQUEUE in kinds(s), timeout=15)
    assert lost.error_code == "job_lost" and "requeued" in lost.message


def test_jobs_are_not_judged_before_the_informers_have_listed(fake_api, monkeypatch):
    """Empty caches before the first list must not read as "every Job is gone"."""
    ex = KubernetesExecutor(fake_api.api_client(), [rtx4090(2)], options=ManifestOptions(namespace=NAMESPACE),
                            running_jobs=lambda: [RunningRow("ftjob-Early", "org-1", 50, "rtx4090", 1, 0.0)])
    monkeypatch.setattr(ex, "sync", lambda: None)  # the informers have not listed yet
    assert ex.reconcile() == [] and ex.tracked == {}
    monkeypatch.undo()
    (lost,) = ex.reconcile()  # listed: now the missing Job is a fact
    assert (lost.job_id, lost.error_code) == ("ftjob-Early", "job_lost")


# --- the real cycle on the database -------------------------------------------------


def _cycle_until(store, ex, pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run_cycle(store, ex)
        if pred():
            return
        time.sleep(0.1)
    raise TimeoutError("condition not met in time")


def _job(settings, job_id):
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        events = list(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id)))
        return job.status, job.restarts or 0, (job.error or {}), events


def _pod_of(api, job_id, phase="Running"):
    pods = [p for p in api.cluster.pods(job_id) if p["status"].get("phase") == phase
            and "deletionTimestamp" not in p["metadata"]]
    return pods[0] if pods else None


@pytest.fixture
def db_job(settings, tenant_key, make_job):  # noqa: F811
    _tiny_config(settings)
    return make_job(tenant_key().headers)["id"]


def test_an_oom_kill_after_a_scheduler_restart_fails_the_job(fake_api, settings, db_job):
    store = DbStore(settings, [rtx4090(2)], in_cluster=True)
    old = scheduler_process(fake_api, store.running_jobs)
    _cycle_until(store, old, lambda: _pod_of(fake_api, db_job))
    restart(old)  # e.g. a Helm upgrade: the Recreate Deployment replaces the scheduler

    new = scheduler_process(fake_api, store.running_jobs)
    run_cycle(store, new)
    fake_api.cluster.oom_kill(_pod_of(fake_api, db_job)["metadata"]["name"])
    _cycle_until(store, new, lambda: _job(settings, db_job)[0] != "running")
    status, _, error, events = _job(settings, db_job)
    assert (status, error.get("code")) == ("failed", "out_of_memory"), events
    assert any("OOM-killed" in e for e in events)


def test_out_of_gpu_memory_retries_on_the_next_larger_gang(fake_api, settings, db_job):
    """The estimator chose 1 GPU and the trainer ran out of GPU memory: the job is requeued
    for the pool's next gang (2 GPUs, one node), resumes there and succeeds."""
    store = DbStore(settings, [rtx4090(2)], in_cluster=True)
    ex = scheduler_process(fake_api, store.running_jobs, mode="oom_on_one_gpu")
    _cycle_until(store, ex, lambda: _job(settings, db_job)[0] == "succeeded")
    _, restarts, _, events = _job(settings, db_job)
    oom = [e for e in events if e.startswith("Out of GPU memory")]
    assert restarts == 1 and len(oom) == 1, events
    assert oom[0].startswith("Out of GPU memory on 1x nvidia-rtx-4090 (out of memory: CUDA out of memory); "
                             "requeued for 2 GPUs of pool rtx4090"), oom
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, db_job)
        assert (job.gpus, job.retry_placement, job.placement) == (2, {"pool": "rtx4090", "gpus": 2}, {})


def test_out_of_gpu_memory_on_a_pinned_gpu_count_fails(fake_api, settings, tenant_key, make_job):  # noqa: F811
    """The user chose the GPU count: running out of memory is the job's error, not a retry."""
    _tiny_config(settings)
    job_id = make_job(tenant_key().headers, placement={"gpus": 1})["id"]
    store = DbStore(settings, [rtx4090(2)], in_cluster=True)
    ex = scheduler_process(fake_api, store.running_jobs, mode="oom_on_one_gpu")
    _cycle_until(store, ex, lambda: _job(settings, job_id)[0] in ("failed", "succeeded"))
    status, restarts, error, _ = _job(settings, job_id)
    assert (status, restarts, error.get("code")) == ("failed", 0, "out_of_memory")


def test_node_lost_requeues_then_fails_per_the_restart_policy(fake_api, settings, db_job):
    """Node loss is a lost run: requeued from the last checkpoint, counted as a restart;
    past ``max_restarts`` the job fails with the same clear reason."""
    store = DbStore(settings, [rtx4090(2)], in_cluster=True, max_restarts=1)
    ex = scheduler_process(fake_api, store.running_jobs)
    _cycle_until(store, ex, lambda: _pod_of(fake_api, db_job))
    first = _pod_of(fake_api, db_job)["spec"]["nodeName"]
    fake_api.cluster.lose_node(first)
    _cycle_until(store, ex, lambda: _job(settings, db_job)[1] == 1)
    events = _job(settings, db_job)[3]
    lost = [e for e in events if "lost its node" in e]
    assert lost and f"lost its node: node {first} which was running the pod is unresponsive" in lost[0], events
    assert "requeued from its last checkpoint (restart 1 of 1)" in lost[0]

    # Placed again on the node that is left; losing it too is one restart too many.
    _cycle_until(store, ex, lambda: (p := _pod_of(fake_api, db_job)) and p["spec"]["nodeName"] != first)
    second = _pod_of(fake_api, db_job)["spec"]["nodeName"]
    fake_api.cluster.lose_node(second)
    _cycle_until(store, ex, lambda: _job(settings, db_job)[0] == "failed")
    _, restarts, error, events = _job(settings, db_job)
    assert restarts == 1 and error["code"] == "node_lost" and f"node {second}" in error["message"]
    assert any(f"node {second}" in e and "(gave up after 1 restarts)" in e for e in events), events


def test_a_preemption_by_the_cluster_requeues_without_counting_a_restart(fake_api, settings, db_job):
    """A node drain SIGTERMs the trainer, which checkpoints and exits 12: the Job's
    podFailurePolicy ignores it and the job is requeued from its checkpoint like one of
    our own preemptions -- with no restart allowed, twice, and it is still not failed."""
    import signal

    store = DbStore(settings, [rtx4090(2)], in_cluster=True, max_restarts=0)
    ex = scheduler_process(fake_api, store.running_jobs)

    def preempted() -> list[str]:
        return [e for e in _job(settings, db_job)[3] if "received SIGTERM from the cluster" in e]

    for launch in ("1", "2"):
        # the pod of the job's run attempt 1, then 2
        _cycle_until(store, ex, lambda want=launch: (p := _pod_of(fake_api, db_job)) is not None
                     and p["metadata"]["labels"].get("tunefleet.io/run") == want)
        fake_api.wait_for(lambda: db_job in ex.logs(db_job))  # its SIGTERM handler is set
        fake_api.cluster.procs[_pod_of(fake_api, db_job)["metadata"]["uid"]].send_signal(signal.SIGTERM)
        _cycle_until(store, ex, lambda want=launch: len(preempted()) == int(want))
        status, restarts, _, _ = _job(settings, db_job)
        assert status in ("queued", "running") and restarts == 0
        assert "(not counted as a restart)" in preempted()[-1]


def test_cancel_through_the_api_stops_the_pod_at_once(fake_api, settings, client, tenant_key, make_job):  # noqa: F811
    """The API only moves the job to ``cancelled``; the scheduler's next reconcile sees a
    live Job whose job the database has cancelled and stops it in that cycle (SIGTERM,
    then the Job is deleted), without the grace a trainer that ended by itself gets."""
    _tiny_config(settings)
    key = tenant_key()
    job_id = make_job(key.headers)["id"]
    store = DbStore(settings, [rtx4090(2)], in_cluster=True)
    ex = scheduler_process(fake_api, store.running_jobs, job_statuses=store.job_statuses, orphan_grace_s=300.0)
    _cycle_until(store, ex, lambda: _pod_of(fake_api, job_id))
    fake_api.wait_for(lambda: job_id in ex.logs(job_id))
    uid = _pod_of(fake_api, job_id)["metadata"]["uid"]
    assert client.post(f"{JOBS}/{job_id}/cancel", headers=key.headers).json()["status"] == "cancelled"
    batch = client_batch(fake_api)
    _cycle_until(store, ex, lambda: not batch.list_namespaced_job(NAMESPACE).items, timeout=20)
    assert "SIGTERM: checkpoint written" in fake_api.cluster.read_log(uid)
    assert _job(settings, job_id)[0] == "cancelled"
    assert ("patch", "jobs") in fake_api.cluster.requests  # the reason went on the Job first


def test_a_job_no_longer_running_for_another_reason_is_stopped_after_the_grace(fake_api, settings, db_job):
    """A Job whose job left ``running`` other than by the API's cancel or pause (here: the
    row says succeeded, as after the trainer's final report) gets ``orphan_grace_s`` to
    exit by itself before it is stopped."""
    store = DbStore(settings, [rtx4090(2)], in_cluster=True)
    ex = scheduler_process(fake_api, store.running_jobs, job_statuses=store.job_statuses, orphan_grace_s=1.0)
    _cycle_until(store, ex, lambda: _pod_of(fake_api, db_job))
    uid = _pod_of(fake_api, db_job)["metadata"]["uid"]
    with session_scope(settings.resolved_database_url) as s:
        s.get(Job, db_job).status = "succeeded"
    batch = client_batch(fake_api)
    ended = time.monotonic()
    run_cycle(store, ex)
    assert fake_api.cluster.procs[uid].poll() is None  # within the grace: not yet
    _cycle_until(store, ex, lambda: not batch.list_namespaced_job(NAMESPACE).items)
    assert time.monotonic() - ended >= 1.0


def client_batch(api):
    return client.BatchV1Api(api.api_client())
