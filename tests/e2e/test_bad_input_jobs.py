"""Bad input fails the JOB (not only the trainer): a specific ``error.code`` and an error event.

Through the real service (API, Celery worker, scheduler, trainer subprocess, embedded
backend): a job whose training data vanished from storage after validation, and a job
on a base model with a NaN weight (its first loss is NaN). Neither hangs, neither is
restarted (a user error cannot heal by retrying).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.e2e.test_local_training import TERMINAL, create_job, upload, wait_status
from tests.model_files import nan_copy
from tunefleet.demo import demo_examples

pytestmark = pytest.mark.slow

NAN_MODEL = "tunefleet-tiny-llama-nan"


def assert_failed_with(http, job_id: str, code: str) -> None:
    job = wait_status(http, job_id, TERMINAL, timeout=180)
    assert job["status"] == "failed", job
    assert job["error"]["code"] == code, job["error"]
    assert job["error"]["message"]
    assert job["restarts"] == 0
    events = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    failures = [e for e in events if e["level"] == "error" and code in e["message"]]
    assert any(e["message"].startswith(f"Job failed: {code}") for e in failures), events


def test_missing_dataset_and_nan_loss_fail_the_job(service, tiny_model_dir: Path, tmp_path: Path) -> None:
    registry = tmp_path / "models.yaml"
    registry.write_text(yaml.safe_dump({"models": [
        {"id": "tunefleet-tiny-llama", "path": str(tiny_model_dir), "params_b": 0.0001, "max_seq_len": 512},
        {"id": NAN_MODEL, "path": str(nan_copy(tiny_model_dir, tmp_path / "nan-model")),
         "params_b": 0.0001, "max_seq_len": 512},
    ]}))
    svc = service("embedded", TUNEFLEET_BASE_MODELS_FILE=registry)
    with svc.http() as http:
        file_id = upload(http, demo_examples(16, seed=5))
        nan_job = http.post("/fine_tuning/jobs", json={
            "model": NAN_MODEL, "training_file": file_id, "seed": 7, "max_seq_len": 48,
            "hyperparameters": {"n_epochs": 1, "batch_size": 8},
        })
        assert nan_job.status_code == 200, nan_job.text

        # Validated, then gone from storage (a lost volume, an operator's clean-up).
        gone_id = upload(http, demo_examples(16, seed=6), name="gone.jsonl")
        blob = svc.data_dir / "files" / f"{gone_id}.jsonl"
        assert blob.is_file()
        blob.unlink()
        gone_job = create_job(http, gone_id)

        assert_failed_with(http, nan_job.json()["id"], "nan_loss")
        assert_failed_with(http, gone_job["id"], "dataset_not_found")
