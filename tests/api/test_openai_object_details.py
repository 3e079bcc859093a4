"""The details of OpenAI's objects that real clients check, through the official SDK:
list files (order, limit, purpose, cursor), files that expire (``expires_after``), event
objects (``type`` and ``level`` as the SDK's literals say, metric events), and deleting
a fine-tuned model."""

from __future__ import annotations

import datetime as dt
import io

import openai
import pytest

from tests.api.conftest import chat_lines


def _upload(oai, n: int = 2, **kwargs):
    return oai.files.create(file=("train.jsonl", io.BytesIO(chat_lines(n))), purpose="fine-tune", **kwargs)


# ---- list files ------------------------------------------------------------------------


def test_list_files_order_limit_purpose_and_cursor(sdk, client) -> None:
    oai, tenant = sdk
    ids = [_upload(oai).id for _ in range(3)]

    assert [f.id for f in oai.files.list().data] == ids[::-1]  # newest first by default
    assert [f.id for f in oai.files.list(order="asc").data] == ids
    page = oai.files.list(order="asc", limit=2)
    assert [f.id for f in page.data] == ids[:2] and page.has_more
    assert [f.id for f in oai.files.list(order="asc", limit=2)] == ids  # auto-paging by `after`
    assert [f.id for f in oai.files.list(order="desc", after=ids[2], limit=10_000)] == ids[1::-1]
    assert oai.files.list(purpose="fine-tune-results").data == []
    assert [f.id for f in oai.files.list(purpose="fine-tune", order="asc")] == ids

    for query, param in (("limit=10001", "limit"), ("limit=0", "limit"), ("order=newest", "order")):
        response = client.get(f"/v1/files?{query}", headers=tenant.headers)
        assert response.status_code == 400, (query, response.text)
        assert response.json()["error"]["param"] == param


def test_list_files_returns_more_than_a_hundred_in_one_page(sdk, client, settings, db_session) -> None:
    from control.db.models import File
    from control.ids import new_id

    oai, tenant = sdk
    created = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    for i in range(150):
        db_session.add(File(id=new_id("file"), tenant_id=tenant.tenant_id, filename="x.jsonl", bytes=1,
                            purpose="fine-tune", status="processed", location=f"files/none-{i}", sha256="0" * 64,
                            created_at=created + dt.timedelta(seconds=i)))
    db_session.commit()
    page = oai.files.list()  # OpenAI's default page is 10,000 files
    assert len(page.data) == 150 and not page.has_more
    assert [f.created_at for f in page.data] == sorted((f.created_at for f in page.data), reverse=True)


# ---- files that expire -----------------------------------------------------------------


def test_expires_after_sets_expires_at(sdk, client) -> None:
    oai, tenant = sdk
    kept = _upload(oai)
    assert kept.expires_at is None
    expiring = _upload(oai, expires_after={"anchor": "created_at", "seconds": 3600})
    assert expiring.expires_at == expiring.created_at + 3600
    assert oai.files.retrieve(expiring.id).expires_at == expiring.expires_at

    # A client following the OpenAPI document sends the object as one JSON part.
    response = client.post("/v1/files", headers=tenant.headers,
                           files={"file": ("t.jsonl", chat_lines(2))},
                           data={"purpose": "fine-tune",
                                 "expires_after": '{"anchor": "created_at", "seconds": 2592000}'})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["expires_at"] == body["created_at"] + 2592000


@pytest.mark.parametrize(("policy", "param"), [
    ({"anchor": "created_at", "seconds": 3599}, "expires_after.seconds"),
    ({"anchor": "created_at", "seconds": 2592001}, "expires_after.seconds"),
    ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
    ({"seconds": 3600}, "expires_after.anchor"),
    ({"anchor": "created_at"}, "expires_after.seconds"),
], ids=["under-an-hour", "over-30-days", "other-anchor", "no-anchor", "no-seconds"])
def test_expires_after_out_of_bounds_is_400(sdk, policy, param) -> None:
    oai, _ = sdk
    with pytest.raises(openai.BadRequestError) as caught:
        _upload(oai, expires_after=policy)
    assert caught.value.code == "invalid_request" and caught.value.param == param
    assert oai.files.list().data == []  # nothing stored


def test_expires_after_that_is_not_an_object_is_400(client, tenant_key) -> None:
    headers = tenant_key().headers
    for value in ("3600", "not json", '{"anchor": "created_at", "seconds": "3600.5"}'):
        response = client.post("/v1/files", headers=headers, files={"file": ("t.jsonl", chat_lines(2))},
                               data={"purpose": "fine-tune", "expires_after": value})
        assert response.status_code == 400, (value, response.text)
        assert response.json()["error"]["param"].startswith("expires_after")


@pytest.fixture
def expiry_task(settings, monkeypatch):
    from worker.tasks import files as task

    monkeypatch.setattr(task, "get_settings", lambda: settings)
    return task.delete_expired_files_task


def _expire(db_session, file_id: str) -> str:
    """Move the file's expiry into the past; returns its storage key."""
    from control.db.models import File

    row = db_session.get_one(File, file_id)
    row.expires_at = row.created_at - dt.timedelta(seconds=1)
    db_session.commit()
    return row.location


def test_expired_files_are_deleted_once_no_unfinished_job_uses_them(
    sdk, client, app, db_session, expiry_task
) -> None:
    oai, _ = sdk
    store = app.state.file_store
    unused = _upload(oai, expires_after={"anchor": "created_at", "seconds": 3600})
    in_use = _upload(oai, expires_after={"anchor": "created_at", "seconds": 3600})
    later = _upload(oai, expires_after={"anchor": "created_at", "seconds": 7200})
    job = oai.fine_tuning.jobs.create(model="tunefleet-tiny-llama", training_file=in_use.id)
    unused_key, in_use_key = _expire(db_session, unused.id), _expire(db_session, in_use.id)

    # Past its expiry a file is gone for its tenant at once, before any sweep.
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(unused.id)
    assert [f.id for f in oai.files.list()] == [later.id]
    with pytest.raises(openai.BadRequestError):
        oai.fine_tuning.jobs.create(model="tunefleet-tiny-llama", training_file=unused.id)

    deleted = expiry_task()
    assert unused.id in deleted and in_use.id not in deleted and later.id not in deleted
    assert not store.exists(unused_key)
    # The queued job's trainer reads its training file when it starts: kept until the job ends.
    assert store.exists(in_use_key)
    assert unused.id not in expiry_task()  # deleted once

    oai.fine_tuning.jobs.cancel(job.id)
    assert in_use.id in expiry_task()
    assert not store.exists(in_use_key)
    assert oai.files.retrieve(later.id).id == later.id


# ---- deleting a fine-tuned model --------------------------------------------------------


@pytest.fixture
def adapter_job(client, make_job, settings, db_session):
    """A job of ``key`` that ran and exported an adapter, ``succeeded`` unless told to stay
    running; returns (job id, fine-tuned model id, output dir)."""
    from control.jobs.lifecycle import transition
    from tests.api.conftest import start_running

    def make(key, *, finish: bool = True):
        job = make_job(key.headers)
        row, token = start_running(db_session, job["id"])
        out = settings.data_path / "artifacts" / job["id"] / "output"
        (out / "adapter").mkdir(parents=True)
        (out / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
        (out / "adapter" / "adapter_config.json").write_text("{}")
        (out / "train_log.jsonl").write_text("{}\n")  # left by the trainer, not registered
        files = [{"name": "adapter/adapter_model.safetensors", "bytes": 7, "sha256": "0" * 64},
                 {"name": "adapter/adapter_config.json", "bytes": 2, "sha256": "1" * 64}]
        response = client.post(f"/internal/v1/jobs/{job['id']}/reports", headers={"Authorization": f"Bearer {token}"},
                               json={"seq": 1, "items": [{"type": "artifacts", "location": str(out), "files": files}]})
        assert response.status_code == 200, response.text
        db_session.refresh(row)
        if finish:
            transition(db_session, row, "succeeded", actor="executor")
            db_session.commit()
        model = row.fine_tuned_model
        assert model is not None
        return job["id"], model, out

    return make


def test_delete_a_fine_tuned_model(sdk, client, adapter_job) -> None:
    oai, tenant = sdk
    job_id, model, out = adapter_job(tenant)
    assert model in [m.id for m in oai.models.list()]

    deleted = oai.models.delete(model)
    assert (deleted.id, deleted.object, deleted.deleted) == (model, "model", True)
    assert model not in [m.id for m in oai.models.list()]
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve(model)
    assert not [p for p in out.rglob("*") if p.is_file()]  # every output, registered or not
    listed = client.get(f"/v1/fine_tuning/jobs/{job_id}/artifacts", headers=tenant.headers).json()
    assert listed["data"] == []
    # The job keeps its record of what it made.
    assert oai.fine_tuning.jobs.retrieve(job_id).fine_tuned_model == model
    with pytest.raises(openai.NotFoundError):
        oai.models.delete(model)  # once


def test_delete_model_refusals(sdk, client, tenant_key, adapter_job) -> None:
    oai, tenant = sdk
    _, model, out = adapter_job(tenant)
    stranger = tenant_key()

    response = client.delete(f"/v1/models/{model}", headers=stranger.headers)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    with pytest.raises(openai.PermissionDeniedError) as caught:
        oai.models.delete("tunefleet-tiny-llama")
    assert caught.value.code == "base_model_not_deletable"
    assert oai.models.retrieve("tunefleet-tiny-llama").id == "tunefleet-tiny-llama"
    with pytest.raises(openai.NotFoundError):
        oai.models.delete("ft:tunefleet-tiny-llama:none:nothing")

    running_id, running_model, running_out = adapter_job(tenant, finish=False)
    with pytest.raises(openai.ConflictError) as caught:
        oai.models.delete(running_model)
    assert caught.value.code == "job_not_finished" and running_id in caught.value.message
    assert (running_out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()  # the stranger deleted nothing


# ---- event objects ---------------------------------------------------------------------


def test_migration_gives_old_events_openai_levels_and_types(tmp_path) -> None:
    import sqlite3

    from control.db.migrate import upgrade

    path = tmp_path / "old.db"
    upgrade(f"sqlite:///{path}", "0207_file_expiry")
    with sqlite3.connect(path) as db:  # foreign keys off: events of no job do here
        db.executemany(
            "INSERT INTO job_events (id, job_id, created_at, level, message, type) VALUES (?, 'ftjob-x', "
            "'2026-01-01 00:00:00', ?, ?, ?)",
            [("a", "debug", "loading", "message"), ("b", "warning", "slow", "message"),
             ("c", "info", "Checkpoint created at step 5", "metrics"), ("d", "info", "Job running", "status")],
        )
    upgrade(f"sqlite:///{path}")
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT id, level, type FROM job_events ORDER BY id").fetchall()
    assert rows == [("a", "info", "message"), ("b", "warn", "message"), ("c", "info", "message"),
                    ("d", "info", "status")]


def test_events_have_openai_types_levels_and_metrics(sdk, client, make_job, db_session, settings) -> None:
    from tests.api.conftest import start_running

    oai, tenant = sdk
    job = make_job(tenant.headers)
    _, token = start_running(db_session, job["id"])
    steps = [{"type": "metric", "step": s, "total_steps": 100, "train_loss": 3.0 - s / 4, "token_accuracy": s / 10}
             for s in range(1, 6)]
    steps[-1].update(valid_loss=2.5, valid_token_accuracy=0.4)
    items = [*steps, {"type": "event", "level": "debug", "message": "loaded the tokenizer"},
             {"type": "event", "level": "warning", "message": "slow step"},
             {"type": "checkpoint", "step": 5, "location": str(settings.job_dir(job["id"]) / "checkpoints" / "step-5"),
              "metrics": {"train_loss": 1.75}}]
    response = client.post(f"/internal/v1/jobs/{job['id']}/reports", headers={"Authorization": f"Bearer {token}"},
                           json={"seq": 1, "items": items})
    assert response.status_code == 200, response.text
    assert oai.fine_tuning.jobs.pause(job["id"]).status == "paused"

    events = list(oai.fine_tuning.jobs.list_events(job["id"], limit=100))[::-1]  # oldest first
    assert {e.type for e in events} == {"message", "metrics"}
    assert {e.level for e in events} == {"info", "warn"}
    by_message = {e.message: e for e in events}
    assert by_message["loaded the tokenizer"].level == "info"
    assert by_message["slow step"].level == "warn"
    assert by_message["Checkpoint created at step 5"].type == "message"

    metrics = [e for e in events if e.type == "metrics"]
    # 100 steps: every second step is announced, the first, and each one with validation metrics.
    assert [e.data["step"] for e in metrics] == [1, 2, 4, 5]
    assert metrics[0].message == "Step 1/100: training loss=2.7500"
    assert metrics[0].data == {"step": 1, "train_loss": 2.75, "train_mean_token_accuracy": 0.1, "total_steps": 100}
    assert metrics[-1].message == "Step 5/100: training loss=1.7500, validation loss=2.5000"
    assert metrics[-1].data == {"step": 5, "train_loss": 1.75, "train_mean_token_accuracy": 0.5, "valid_loss": 2.5,
                                "valid_mean_token_accuracy": 0.4, "total_steps": 100}

    changes = [e for e in events if e.data and "to" in e.data]
    assert [(e.type, e.data["from"], e.data["to"]) for e in changes] == [
        ("message", "validating_files", "queued"), ("message", "queued", "running"), ("message", "running", "paused")]
