"""Kueue mode on the real cycle and database: tunefleet admits, Kueue starts and evicts.

The scheduler's admission creates the job's Job suspended in the LocalQueue; until Kueue
lets it run, the job stays ``queued`` (its reason says it waits for Kueue), is placed no
second time, holds no usage segment and is billed nothing. When Kueue unsuspends the Job
the job turns ``running``; when Kueue suspends it again (its quota went elsewhere) the
trainer checkpoints on its SIGTERM and the job is requeued without a restart counted, then
admitted afresh (a new, suspended Job).
"""

from __future__ import annotations

import sys

import pytest
from kubernetes import client
from sqlalchemy import select

from control.db.models import Job, JobEvent
from control.db.session import session_scope
from tests.api.conftest import make_job, processed_file, upload  # noqa: F401 (fixtures)
from tests.k8s.conftest import NAMESPACE
from tests.k8s.test_reconcile_restart import FAKE_TRAINER, JOBS, _cycle_until, _open
from tests.worker.builders import rtx4090
from tests.worker.test_db_store import _tiny_config
from worker.executors.kubernetes import KubernetesExecutor
from worker.executors.manifests import SPEC_FILE, ManifestOptions
from worker.scheduler.cycle import run_cycle
from worker.scheduler.store import DbStore

QUEUE = "gpu-jobs"


@pytest.fixture(autouse=True)
def _close_executors():
    yield
    while _open:
        _open.pop().close()


def kueue_scheduler(api, store: DbStore) -> KubernetesExecutor:
    ex = KubernetesExecutor(
        api.api_client(), [rtx4090(2)],
        options=ManifestOptions(namespace=NAMESPACE, termination_grace_period_s=10, kueue_queue=QUEUE),
        command=[sys.executable, FAKE_TRAINER, "--spec", SPEC_FILE], watch_timeout_s=1,
        running_jobs=store.running_jobs, job_statuses=store.job_statuses,
        extra_env={"FAKE_TRAINER_MODE": "sleep"})
    ex.start()
    _open.append(ex)
    return ex


def _row(settings, job_id):
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        events = list(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)))
        s.expunge(job)
        return job, events


def _jobs(api, job_id):
    return [j for j in client.BatchV1Api(api.api_client()).list_namespaced_job(NAMESPACE).items
            if j.metadata.labels.get("tunefleet.io/job-id") == job_id and not j.metadata.deletion_timestamp]


def _set_suspend(api, name: str, suspend: bool) -> None:
    code, _ = api.cluster.patch("jobs", NAMESPACE, name, {"spec": {"suspend": suspend}})
    assert code == 200


@pytest.fixture
def kueue(settings, fake_api):
    _tiny_config(settings)
    store = DbStore(settings.model_copy(update={"kueue_queue": QUEUE}), [rtx4090(2)], in_cluster=True)
    return store, kueue_scheduler(fake_api, store)


def test_a_job_stays_queued_until_kueue_starts_it_then_runs(fake_api, settings, kueue, tenant_key, make_job):  # noqa: F811
    store, ex = kueue
    key = tenant_key()
    job_id = make_job(key.headers)["id"]
    _cycle_until(store, ex, lambda: _jobs(fake_api, job_id))
    for _ in range(3):  # later cycles neither place it again nor start it
        run_cycle(store, ex)
    (k8s_job,) = _jobs(fake_api, job_id)
    assert k8s_job.spec.suspend is True and not fake_api.cluster.pods(job_id)
    job, events = _row(settings, job_id)
    assert job.status == "queued" and job.awaiting_start_since is not None
    assert job.queue_reason == f"admitted, waiting for Kueue (LocalQueue {QUEUE})"
    assert job.pool == "rtx4090" and job.attempt == 1 and job.started_at is None
    assert not (job.usage or {}).get("segments"), job.usage  # nothing is billed while Kueue holds it
    assert sum("waiting for Kueue" in e for e in events) == 1, events  # said once, not every cycle

    _set_suspend(fake_api, k8s_job.metadata.name, False)  # Kueue admits the workload
    _cycle_until(store, ex, lambda: _row(settings, job_id)[0].status == "running", timeout=20)
    job, events = _row(settings, job_id)
    assert job.awaiting_start_since is None and job.queue_reason is None and job.started_at is not None
    (segment,) = job.usage["segments"]
    assert segment["pool"] == "rtx4090" and segment["end"] is None and "pending_segment" not in job.usage
    assert "Kueue started the Job: the trainer is running." in events

    # Kueue evicts it: the trainer checkpoints on SIGTERM; requeued without a restart, then
    # admitted again onto a new suspended Job
    _set_suspend(fake_api, k8s_job.metadata.name, True)
    _cycle_until(store, ex, lambda: _row(settings, job_id)[0].attempt == 2, timeout=30)
    job, events = _row(settings, job_id)
    assert job.status == "queued" and job.awaiting_start_since is not None and job.restarts == 0
    assert any("Kueue suspended the Job" in e and "not counted as a restart" in e for e in events), events
    assert job.usage["segments"][0]["end"] is not None
    _cycle_until(store, ex, lambda: [j.metadata.labels["tunefleet.io/run"] for j in _jobs(fake_api, job_id)] == ["2"])
    (second,) = _jobs(fake_api, job_id)
    assert second.spec.suspend is True


def test_cancelling_a_job_kueue_holds_deletes_its_job_at_once(fake_api, settings, kueue, client, tenant_key,
                                                              make_job):  # noqa: F811
    store, ex = kueue
    key = tenant_key()
    job_id = make_job(key.headers)["id"]
    _cycle_until(store, ex, lambda: _jobs(fake_api, job_id))
    cancelled = client.post(f"{JOBS}/{job_id}/cancel", headers=key.headers)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    _cycle_until(store, ex, lambda: not _jobs(fake_api, job_id), timeout=15)
    job, _ = _row(settings, job_id)
    assert job.status == "cancelled" and job.awaiting_start_since is None
    assert not (job.usage or {}).get("segments") and "pending_segment" not in (job.usage or {})


def test_a_report_from_a_trainer_kueue_started_moves_the_job_to_running(settings, kueue, tenant_key, make_job,  # noqa: F811
                                                                       fake_api, client):
    """The trainer may report before the scheduler sees its pod run: its token works from
    the admission, and its first report moves the job to ``running``."""
    store, ex = kueue
    key = tenant_key()
    job_id = make_job(key.headers)["id"]
    _cycle_until(store, ex, lambda: _jobs(fake_api, job_id))
    (k8s_job,) = _jobs(fake_api, job_id)
    secret = client_secret(fake_api, k8s_job)
    sent = client.post(f"/internal/v1/jobs/{job_id}/reports", headers={"Authorization": f"Bearer {secret}"},
                       json={"seq": 1, "items": [{"type": "event", "level": "info", "message": "model loaded"}]})
    assert sent.status_code == 200, sent.text
    job, events = _row(settings, job_id)
    assert job.status == "running" and job.awaiting_start_since is None and job.usage["segments"]
    assert events.index("Kueue started the Job: the trainer is running.") < events.index("model loaded")


def client_secret(api, k8s_job) -> str:
    """The job token the executor put in the Job's Secret (what the trainer pod gets)."""
    import base64

    core = client.CoreV1Api(api.api_client())
    (secret,) = [s for s in core.list_namespaced_secret(NAMESPACE).items
                 if s.metadata.name.startswith(k8s_job.metadata.name)]
    return base64.b64decode(next(iter(secret.data.values()))).decode()
