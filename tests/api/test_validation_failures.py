"""No upload stays ``uploaded`` forever, and no job waits on one forever.

- a validation task that raises (here: the stored bytes are gone) ends the file ``error``
  with ``validation_failed`` and the reason, and fails the job waiting for it;
- ``tunefleet.sweep_stale_validations`` fails files still ``uploaded`` past
  ``file_validation_deadline_s`` and their jobs, and leaves younger ones alone;
- the scheduler loop sends that sweep.
"""

from __future__ import annotations

import datetime as dt
import threading

import pytest


@pytest.fixture
def unvalidated(client, upload, inline_queue, tenant_key):
    """Factory: (key, file id, job id) for an upload whose validation never ran."""
    inline_queue.run_validation = False  # as if the task was lost or is still queued

    def make() -> tuple:
        key = tenant_key()
        file_id = upload(key.headers).json()["id"]
        job = client.post("/v1/fine_tuning/jobs", headers=key.headers,
                          json={"model": "tunefleet-tiny-llama", "training_file": file_id}).json()
        assert job["status"] == "validating_files", job
        return key, file_id, job["id"]

    return make


@pytest.fixture
def task_settings(settings, monkeypatch):
    from worker.tasks import files as task

    monkeypatch.setattr(task, "get_settings", lambda: settings)
    return task


def _answers(client, key, file_id: str, job_id: str) -> tuple[dict, dict]:
    file = client.get(f"/v1/files/{file_id}", headers=key.headers).json()
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=key.headers).json()
    return file, job


def test_a_crashed_validation_fails_the_file_and_its_job(
    client, unvalidated, task_settings, settings, db_session
) -> None:
    from control.db.models import File

    key, file_id, job_id = unvalidated()
    stored = db_session.get_one(File, file_id).location
    task_settings.file_store(settings).delete(stored)  # reading it now raises

    assert task_settings.validate_file_task(file_id) == []  # handled, not raised

    file, job = _answers(client, key, file_id, job_id)
    assert file["status"] == "error"
    assert file["status_details"].startswith("validation_failed: ")
    assert file["validation"]["errors"][0]["code"] == "validation_failed"
    assert "Error" in file["validation"]["errors"][0]["message"]  # the exception, by name
    assert job["status"] == "failed"
    assert job["error"]["code"] == "validation_failed" and job["error"]["param"] == "training_file"


def test_the_sweep_fails_uploads_past_the_deadline_only(
    client, unvalidated, task_settings, settings, db_session
) -> None:
    from control.db.models import File

    old_key, old_file, old_job = unvalidated()
    new_key, new_file, new_job = unvalidated()
    row = db_session.get_one(File, old_file)
    row.created_at = row.created_at - dt.timedelta(seconds=settings.file_validation_deadline_s + 60)
    db_session.commit()

    assert old_file in task_settings.sweep_stale_validations()

    file, job = _answers(client, old_key, old_file, old_job)
    assert file["status"] == "error" and "not validated within 900 s" in file["status_details"]
    assert (job["status"], job["error"]["code"]) == ("failed", "validation_failed")
    file, job = _answers(client, new_key, new_file, new_job)
    assert (file["status"], job["status"]) == ("uploaded", "validating_files")
    assert old_file not in task_settings.sweep_stale_validations()  # decided once


def test_the_scheduler_loop_sends_the_sweep(settings, monkeypatch) -> None:
    import control.queue
    from worker.scheduler.loop import run_forever

    sent: list[str] = []

    class Recording:
        def __init__(self, _settings) -> None:
            pass

        def send(self, name: str, *args, **kwargs) -> bool:
            sent.append(name)
            return True

    monkeypatch.setattr(control.queue, "CeleryQueue", Recording)
    run_forever(settings.model_copy(update={"schedule_interval_s": 0.01}),
                stop=threading.Event(), max_cycles=1)
    # The validation-deadline sweep, the one that deletes files past their expires_after, and
    # the one that ends uploads pending past their hour.
    assert {"tunefleet.sweep_stale_validations", "tunefleet.delete_expired_files",
            "tunefleet.expire_uploads"} <= set(sent)
