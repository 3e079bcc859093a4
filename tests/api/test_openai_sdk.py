"""The official ``openai`` SDK drives the API unchanged and parses every object."""

from __future__ import annotations

import csv
import io

import openai
import pytest
from openai import OpenAI

from tests.api.conftest import chat_lines, start_running
from worker.executors.local.process import TrainerOutcome
from worker.executors.local.supervisor import finish


def test_openai_sdk_end_to_end(sdk, client, db_session, settings) -> None:
    oai, tenant = sdk
    uploaded = oai.files.create(file=("train.jsonl", io.BytesIO(chat_lines(8))), purpose="fine-tune")
    assert uploaded.object == "file" and uploaded.purpose == "fine-tune"
    assert uploaded.bytes == len(chat_lines(8)) and uploaded.filename == "train.jsonl"
    assert oai.files.retrieve(uploaded.id).status == "processed"

    job = oai.fine_tuning.jobs.create(
        model="tunefleet-tiny-llama", training_file=uploaded.id, seed=3, suffix="sdk",
        hyperparameters={"n_epochs": 2}, metadata={"via": "sdk"},
        extra_body={"adapter": {"r": 4}, "priority": "low"},
    )
    assert job.object == "fine_tuning.job" and job.status == "queued"
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 1
    assert job.seed == 3 and job.organization_id == tenant.tenant_id
    assert job.training_file == uploaded.id and job.metadata == {"via": "sdk"}

    second = oai.fine_tuning.jobs.create(model="tunefleet-tiny-llama", training_file=uploaded.id)
    listed = oai.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in listed.data] == [second.id] and listed.has_more
    assert [j.id for j in oai.fine_tuning.jobs.list(limit=1)] == [second.id, job.id]  # auto-paging
    assert oai.fine_tuning.jobs.retrieve(job.id).id == job.id

    _row, token = start_running(db_session, job.id)
    client.post(f"/internal/v1/jobs/{job.id}/reports",
                headers={"Authorization": f"Bearer {token}"},
                json={"seq": 0, "items": [{"type": "checkpoint", "step": 5,
                                            "location": str(settings.job_dir(job.id) / "checkpoints" / "step-5"),
                                            "metrics": {"train_loss": 0.5, "valid_loss": 0.6}}]})
    checkpoints = oai.fine_tuning.jobs.checkpoints.list(job.id)
    assert len(checkpoints.data) == 1
    checkpoint = checkpoints.data[0]
    assert checkpoint.step_number == 5 and checkpoint.fine_tuning_job_id == job.id
    assert checkpoint.metrics.train_loss == 0.5 and checkpoint.metrics.valid_loss == 0.6

    cancelled = oai.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    events = oai.fine_tuning.jobs.list_events(job.id, limit=50)
    assert events.data[0].object == "fine_tuning.job.event"
    assert events.data[0].message == "Job cancelled by the user."
    assert {e.level for e in events.data} <= {"info", "warn", "error"}

    with pytest.raises(openai.NotFoundError):
        oai.fine_tuning.jobs.retrieve("ftjob-missing")
    with pytest.raises(openai.BadRequestError) as caught:
        oai.fine_tuning.jobs.create(model="no-such-model", training_file=uploaded.id)
    assert caught.value.code == "invalid_model" and caught.value.param == "model"
    with pytest.raises(openai.ConflictError):
        oai.fine_tuning.jobs.cancel(job.id)
    with pytest.raises(openai.AuthenticationError):
        OpenAI(api_key="tf_nope", base_url="http://testserver/v1", http_client=client,
               max_retries=0).fine_tuning.jobs.list()


def test_openai_sdk_reads_the_results_file_of_a_succeeded_job(sdk, client, db_session, settings, tmp_path) -> None:
    oai, _ = sdk
    uploaded = oai.files.create(file=("train.jsonl", io.BytesIO(chat_lines(8))), purpose="fine-tune")
    job = oai.fine_tuning.jobs.create(model="tunefleet-tiny-llama", training_file=uploaded.id)
    _row, token = start_running(db_session, job.id)
    metrics = [{"type": "metric", "step": s, "train_loss": 3.0 / s, "token_accuracy": s / 4} for s in (1, 2)]
    client.post(f"/internal/v1/jobs/{job.id}/reports", headers={"Authorization": f"Bearer {token}"},
                json={"seq": 1, "items": metrics})
    # The local executor's task records the trainer's success.
    assert finish(settings, job.id, str(tmp_path), TrainerOutcome(0), None) == "succeeded"

    done = oai.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded" and len(done.result_files) == 1
    results = oai.files.retrieve(done.result_files[0])
    assert results.purpose == "fine-tune-results" and results.status == "processed"
    assert [f.id for f in oai.files.list(purpose="fine-tune-results")] == [results.id]
    rows = list(csv.DictReader(io.StringIO(oai.files.content(results.id).text)))
    assert [(r["step"], r["train_loss"], r["train_accuracy"], r["valid_loss"]) for r in rows] == [
        ("1", "3.0", "0.25", ""), ("2", "1.5", "0.5", "")]
