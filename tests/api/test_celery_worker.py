"""A real Celery worker process validates uploads: SQLite + server-less broker, and
PostgreSQL + Redis. The API sends ``tunefleet.validate_file`` by name through the broker."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from tests.api.conftest import BAD_LINES, chat_lines
from tests.conftest import make_settings


@pytest.fixture
def broker_settings(backend, settings, request):
    if backend == "postgres":
        return make_settings(settings.data_path, database_url=settings.resolved_database_url,
                             broker_url=request.getfixturevalue("redis_url"))
    return settings


def _wait_for(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError("timed out")


def test_worker_validates_and_queues(broker_settings, tenant_key, celery_worker) -> None:
    worker = celery_worker(broker_settings)
    headers = tenant_key().headers
    with TestClient(create_app(broker_settings), raise_server_exceptions=False) as client:
        good = client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                           files={"file": ("t.jsonl", chat_lines(4))}).json()
        bad = client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                          files={"file": ("b.jsonl", BAD_LINES)}).json()
        assert good["status"] == bad["status"] == "uploaded"
        # More GPUs than the local pool has, queued anyway: the job stays queued once its file
        # is validated (it would start training otherwise, now that the model's files are there).
        job = client.post("/v1/fine_tuning/jobs", headers=headers, json={
            "model": "tunefleet-tiny-llama", "training_file": good["id"],
            "placement": {"gpus": 64, "queue_if_unfit": True}}).json()
        assert job["status"] == "validating_files"

        def status(file_id: str) -> str | None:
            body = client.get(f"/v1/files/{file_id}", headers=headers).json()
            return body["status"] if body["status"] != "uploaded" else None

        assert _wait_for(lambda: status(good["id"])) == "processed", worker.poll()
        assert _wait_for(lambda: status(bad["id"])) == "error"
        job = client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=headers).json()
        assert job["status"] == "queued" and job["hyperparameters"]["n_epochs"] == 25
        assert worker.poll() is None


def test_worker_start_resends_lost_validations(broker_settings, tenant_key, celery_worker,
                                               client, inline_queue) -> None:
    """A file whose validation task was lost is validated when a worker starts."""
    headers = tenant_key().headers
    inline_queue.run_validation = False  # the task is "lost": nothing validates the upload
    file_id = client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                          files={"file": ("t.jsonl", chat_lines(2))}).json()["id"]
    assert client.get(f"/v1/files/{file_id}", headers=headers).json()["status"] == "uploaded"
    celery_worker(broker_settings)
    assert _wait_for(lambda: client.get(f"/v1/files/{file_id}", headers=headers).json()["status"]
                     != "uploaded") is True
    assert client.get(f"/v1/files/{file_id}", headers=headers).json()["status"] == "processed"
