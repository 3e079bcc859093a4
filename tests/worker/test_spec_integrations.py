"""Experiment trackers from the API to the trainer: a job-create body's ``integrations``
become the trainer spec's ``IntegrationSpec`` values (worker/spec_builder.py), and the
trainer's tracker mirror built from that spec writes to the trackers.

The job is created through the real API (SQLite migrated by Alembic, file validation run
inline) and its spec built the way the scheduler's admission builds it, then written and
loaded again as the trainer reads it. The trackers are read back with their own clients:
MLflow's ``MlflowClient`` on a local file store (standing in for the job's allowed
tracking server), W&B's offline run log.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from control.db.models import Job
from tests.integrations.test_trackers import wandb_records
from trainers.common.integrations import mirror_from_spec
from trainers.spec import IntegrationSpec, TrainerSpec
from worker.spec_builder import build_spec, write_spec


def _chat_lines(n: int = 8) -> bytes:
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{2 * i}"}]} for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_job_body_integrations_reach_the_trainer_spec_and_the_trackers(
    client, tenant_key, db_session, settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import wandb  # noqa: F401 (dev dependencies: the test fails, not skips, without them)
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store is opt-in
    # The job names an operator-allowed tracking server; the trainer side below mirrors to
    # a file store in its place (a job may not name file: or sqlite: stores itself).
    store_uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking_uri = "http://mlflow.tracking.svc:5000"
    client.app.state.settings = settings = settings.model_copy(
        update={"tracker_allowed_hosts": "mlflow.tracking.svc:5000"})

    headers = tenant_key().headers
    upload = client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                         files={"file": ("train.jsonl", _chat_lines(), "application/jsonl")})
    assert upload.status_code == 200, upload.text
    integrations = [
        {"type": "mlflow", "mlflow": {"tracking_uri": tracking_uri, "experiment": "exp-api", "run_name": "run-m"}},
        {"type": "wandb", "wandb": {"project": "proj-api", "name": "run-w", "entity": "team-x",
                                    "tags": ["nightly", "7b"]}},
    ]
    created = client.post("/v1/fine_tuning/jobs", headers=headers, json={
        "model": "tunefleet-tiny-llama", "training_file": upload.json()["id"], "integrations": integrations})
    assert created.status_code == 200, created.text
    assert created.json()["integrations"] == integrations

    job = db_session.get(Job, created.json()["id"])
    spec = build_spec(db_session, job, settings, pool_accelerator="cpu",
                      pool_families=("fsdp_qlora", "jax_lora"), gpus=1, token="t")
    assert spec.integrations == (
        IntegrationSpec(type="mlflow", tracking_uri=tracking_uri, project="exp-api", name="run-m"),
        IntegrationSpec(type="wandb", project="proj-api", name="run-w", entity="team-x", tags=("nightly", "7b")),
    )
    loaded = TrainerSpec.load(write_spec(spec, tmp_path / "spec.json"))  # what the trainer reads
    assert loaded.integrations == spec.integrations

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    local = loaded.model_copy(update={"integrations": (
        loaded.integrations[0].model_copy(update={"tracking_uri": None}), *loaded.integrations[1:])})
    warnings: list[str] = []
    mirror = mirror_from_spec(local, warn=warnings.append)
    assert mirror is not None and [t.name for t in mirror.trackers] == ["mlflow", "wandb"], warnings
    for step, loss in ((1, 2.0), (2, 1.5)):
        mirror.add({"type": "metric", "step": step, "total_steps": 2, "train_loss": loss})
    mirror.close()
    assert warnings == []

    mlflow = MlflowClient(tracking_uri=store_uri)
    (run,) = mlflow.search_runs([mlflow.get_experiment_by_name("exp-api").experiment_id])
    assert run.info.run_name == "run-m" and run.data.tags["tunefleet.job_id"] == job.id
    history = sorted(mlflow.get_metric_history(run.info.run_id, "train_loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.5)]

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 20  # wandb-core writes its `exit` record last, maybe after finish()
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(run_file)):
        assert time.monotonic() < deadline, "wandb never wrote the exit record"
        time.sleep(0.1)
    (wandb_run,) = [r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
    assert (wandb_run.project, wandb_run.display_name, wandb_run.entity) == ("proj-api", "run-w", "team-x")
    assert list(wandb_run.tags) == ["nightly", "7b"]
    losses = [json.loads(i.value_json) for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history"
              for i in r.history.item if (i.key or "/".join(i.nested_key)) == "train_loss"]
    assert losses == [2.0, 1.5]
