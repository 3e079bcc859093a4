"""On the fake cluster, a trainer pod whose reports never reached the API: the job's records
come from what the pod left in the job's storage (``worker.report_gaps``).

A pod's report spool lives on the pod's own disk and dies with it. The fake trainer
(``fake_trainer.py``, modes ``unreported*``) writes what the real one writes -- the
output's ``metrics.jsonl``, ``step-<N>/`` checkpoints in the job's checkpoint storage
(here a shared volume; the bucket is read through the same artifact store, tested at the
end) -- and reports none of it:

- the API is down while the pod finishes: the job succeeds with every step's metrics and
  both checkpoints, read back from storage;
- the pod is killed right after its step-4 checkpoint, or its node is lost: the requeued
  job has steps 1-4 and the checkpoint, and resumes from step-4, not from the start.

The real cycle runs on the test database (``DbStore``, ``run_cycle``), as in
``test_reconcile_restart.py``.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from control.artifacts import artifact_store
from control.db.models import Checkpoint, Job, JobMetric
from control.db.session import session_scope
from tests.api.conftest import make_job, processed_file, upload  # noqa: F401 (fixtures)
from tests.conftest import free_port
from tests.k8s.test_reconcile_restart import _cycle_until, _job, _pod_of, db_job, scheduler_process  # noqa: F401
from tests.worker.builders import rtx4090
from worker.report_gaps import TrainerOutputs
from worker.scheduler.store import DbStore


def _records(settings, job_id: str) -> tuple[list[int], list[int], str | None, dict | None]:
    """(metric steps, listed checkpoint steps, resume_from, report_gaps)."""
    with session_scope(settings.resolved_database_url) as s:
        steps = sorted(s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id)))
        checkpoints = sorted(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))
        job = s.get(Job, job_id)
        return steps, checkpoints, job.resume_from, job.report_gaps


def test_the_api_down_while_the_pod_finishes_loses_no_record(fake_api, settings, db_job):  # noqa: F811
    store = DbStore(settings, [rtx4090(2)], in_cluster=True)
    ex = scheduler_process(fake_api, store.running_jobs, mode="unreported")
    _cycle_until(store, ex, lambda: _job(settings, db_job)[0] not in ("queued", "running"))
    status, _, error, events = _job(settings, db_job)
    assert status == "succeeded", (error, events)
    assert _records(settings, db_job) == (list(range(1, 9)), [4, 8], None, None)
    assert any(e.startswith("Recovered from the trainer's outputs") for e in events), events


@pytest.mark.parametrize("fault", ["pod_killed", "node_lost"])
def test_a_pod_lost_right_after_a_checkpoint_resumes_from_it_with_its_steps(fake_api, settings, db_job, fault):  # noqa: F811
    store = DbStore(settings, [rtx4090(2)], in_cluster=True)
    ex = scheduler_process(fake_api, store.running_jobs, mode="unreported_then_hang")
    _cycle_until(store, ex, lambda: (p := _pod_of(fake_api, db_job)) is not None
                 and "outputs written" in fake_api.cluster.read_log(p["metadata"]["uid"]))
    pod = _pod_of(fake_api, db_job)
    if fault == "pod_killed":
        fake_api.cluster.procs[pod["metadata"]["uid"]].kill()
    else:
        fake_api.cluster.lose_node(pod["spec"]["nodeName"])
    _cycle_until(store, ex, lambda: _job(settings, db_job)[1] == 1)
    steps, checkpoints, resume_from, _ = _records(settings, db_job)
    assert (steps, checkpoints) == ([1, 2, 3, 4], [4])
    assert resume_from == artifact_store(settings).location(f"{db_job}/checkpoints/step-4")


def test_the_outputs_are_read_back_from_the_bucket(settings, monkeypatch):
    """The same reader on an S3 artifact store (moto): the metrics log and the complete
    checkpoints, an incomplete one (no trainer_state.json yet) left out."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    moto.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="k", aws_secret_access_key="s")
        s3.create_bucket(Bucket="outputs")
        job = "ftjob-bucket"
        rows = "".join(json.dumps({"step": s, "total_steps": 8, "train_loss": 1.0}) + "\n" for s in range(1, 7))
        s3.put_object(Bucket="outputs", Key=f"art/{job}/output/metrics.jsonl", Body=rows.encode())
        s3.put_object(Bucket="outputs", Key=f"art/{job}/checkpoints/step-4/trainer_state.json",
                      Body=json.dumps({"step": 4, "metrics": {"train_loss": 0.5}}).encode())
        s3.put_object(Bucket="outputs", Key=f"art/{job}/checkpoints/step-8/adapter/adapter_model.safetensors",
                      Body=b"w")
        bucket_settings = settings.model_copy(update={"artifact_url": "s3://outputs/art", "s3_endpoint_url": endpoint})
        for name, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                            "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(name, value)
        outputs = TrainerOutputs(bucket_settings, job)
        assert sorted(outputs.metric_rows()) == [1, 2, 3, 4, 5, 6]
        (checkpoint,) = outputs.checkpoints().values()
        assert (checkpoint.step, checkpoint.location, checkpoint.metrics) == (
            4, f"s3://outputs/art/{job}/checkpoints/step-4", {"train_loss": 0.5})
    finally:
        moto.stop()
