"""A succeeded job gets ``result_files``: its per-step metrics as OpenAI's results CSV.

Both executors' outcomes write it (``worker.outcomes.apply_outcome``), in the same
transaction as the status: the local executor's task
(``worker.executors.local.supervisor.finish``) and the scheduler's store (``DbStore``, for
cluster executors). The metrics arrive through the real report
endpoint; the CSV is read back through the files API.
"""

import csv
import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from scheduling.pools import local_pool
from tests.api.conftest import make_job, processed_file, start_running, upload  # noqa: F401 (fixtures)
from worker.executors.base import ObservedChange, ObservedKind
from worker.executors.local.process import TrainerOutcome
from worker.executors.local.supervisor import finish
from worker.scheduler.store import DbStore

JOBS = "/v1/fine_tuning/jobs"
METRICS = [
    {"type": "metric", "step": 1, "total_steps": 3, "train_loss": 2.5, "token_accuracy": 0.125,
     "valid_loss": 2.75, "valid_token_accuracy": 0.1},
    {"type": "metric", "step": 2, "total_steps": 3, "train_loss": 2.0000000000000004, "token_accuracy": 0.25},
    {"type": "metric", "step": 3, "total_steps": 3, "train_loss": 1.5, "token_accuracy": 1 / 3,
     "valid_loss": 1.75, "valid_token_accuracy": 0.3},
]


@pytest.fixture
def running_job(client, tenant_key, make_job, db_session):  # noqa: F811
    """A running job whose trainer reported METRICS through the internal endpoint."""
    tenant = tenant_key()
    job = make_job(tenant.headers)
    _row, token = start_running(db_session, job["id"])
    resp = client.post(f"/internal/v1/jobs/{job['id']}/reports", json={"seq": 1, "items": METRICS},
                       headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 200, resp.text
    return SimpleNamespace(id=job["id"], headers=tenant.headers)


def _cell(value):
    return None if value == "" else float(value)


def assert_results_match_metrics(client, job_id: str, headers: dict) -> None:
    job = client.get(f"{JOBS}/{job_id}", headers=headers).json()
    assert job["status"] == "succeeded"
    assert len(job["result_files"]) == 1
    file_id = job["result_files"][0]
    meta = client.get(f"/v1/files/{file_id}", headers=headers).json()
    assert (meta["purpose"], meta["status"], meta["filename"]) == ("fine-tune-results", "processed",
                                                                  "step_metrics.csv")
    listed = client.get("/v1/files", params={"purpose": "fine-tune-results"}, headers=headers).json()
    assert [f["id"] for f in listed["data"]] == [file_id]

    content = client.get(f"/v1/files/{file_id}/content", headers=headers)
    assert content.status_code == 200
    assert len(content.content) == meta["bytes"]
    assert content.headers["content-type"].startswith("text/csv")
    assert content.headers["content-disposition"] == f'attachment; filename="{file_id}.csv"'
    rows = list(csv.DictReader(io.StringIO(content.text)))
    assert list(rows[0]) == ["step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy"]
    metrics = client.get(f"{JOBS}/{job_id}/metrics", headers=headers).json()["data"]
    assert [
        (int(r["step"]), _cell(r["train_loss"]), _cell(r["train_accuracy"]), _cell(r["valid_loss"]),
         _cell(r["valid_mean_token_accuracy"]))
        for r in rows
    ] == [
        (m["step"], m["train_loss"], m["token_accuracy"], m["valid_loss"], m["valid_token_accuracy"])
        for m in metrics
    ]
    assert len(rows) == len(METRICS)  # the metrics API is not empty either


def test_local_executor_success_writes_the_results_file(client, running_job, settings, tmp_path: Path) -> None:
    status = finish(settings, running_job.id, str(tmp_path / "no-manifest"), TrainerOutcome(0), None)
    assert status == "succeeded"
    assert_results_match_metrics(client, running_job.id, running_job.headers)


def test_cluster_success_writes_the_results_file(client, running_job, settings) -> None:
    store = DbStore(settings, [local_pool(1)])
    store.apply_observed([ObservedChange(running_job.id, ObservedKind.SUCCEEDED)])
    assert_results_match_metrics(client, running_job.id, running_job.headers)


def test_a_failed_job_has_no_result_files(client, running_job, settings, tmp_path: Path) -> None:
    outcome = TrainerOutcome(10, error={"code": "invalid_dataset", "message": "line 3 is not JSON"})
    assert finish(settings, running_job.id, str(tmp_path), outcome, None) == "failed"
    job = client.get(f"{JOBS}/{running_job.id}", headers=running_job.headers).json()
    assert job["result_files"] == []
    assert client.get("/v1/files", params={"purpose": "fine-tune-results"},
                      headers=running_job.headers).json()["data"] == []
