"""The sync and async SDK against the running service (uvicorn + the real app)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest

from tests.sdk.conftest import (
    BAD_JSONL,
    DEMO_MODEL,
    JobDriver,
    Service,
    chat_jsonl,
    run_in_fresh_loop,
)
from tunefleet import (
    AsyncTunefleet,
    AuthenticationError,
    BadRequestError,
    ChecksumMismatchError,
    ConflictError,
    NotFoundError,
    Tunefleet,
    WaitTimeoutError,
)


def client_for(service: Service, **kwargs: object) -> Tunefleet:
    return Tunefleet(base_url=service.base_url + "/v1", api_key=service.key, **kwargs)


def test_files_upload_list_get_content_delete(service: Service, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(chat_jsonl(6))
    with client_for(service) as client:
        f = client.files.upload(path, wait=True)
        assert f.status == "processed" and f.filename == "train.jsonl" and f.bytes == path.stat().st_size
        assert f.validation["n_examples"] == 6 and f.validation["format"] == "chat"
        others = [client.files.upload(chat_jsonl(2), filename=f"f{i}.jsonl") for i in range(3)]
        page = client.files.list(limit=2)
        assert len(page.data) == 2 and page.has_more
        # Iterating the page walks the cursor through every page, newest first.
        assert [x.id for x in page] == [o.id for o in reversed(others)] + [f.id]
        assert client.files.retrieve(f.id).id == f.id
        assert client.files.content(f.id) == path.read_bytes()
        assert client.files.delete(f.id).deleted is True
        with pytest.raises(NotFoundError) as exc:
            client.files.retrieve(f.id)
        assert exc.value.status == 404 and exc.value.code == "not_found"


def test_invalid_file_reports_line_numbered_errors(service: Service) -> None:
    with client_for(service) as client:
        f = client.files.upload(BAD_JSONL, filename="bad.jsonl", wait=True)
        assert f.status == "error"
        problems = {(e.line, e.code) for e in f.validation_errors()}
        assert (2, "unrecognized_role") in problems and (3, "invalid_json") in problems
        with pytest.raises(BadRequestError) as exc:
            client.jobs.create(model=DEMO_MODEL, training_file=f.id)
        assert exc.value.param == "training_file" and exc.value.code == "invalid_file"


def test_errors_are_typed_with_code_and_param(service: Service) -> None:
    with Tunefleet(base_url=service.base_url, api_key="tf_wrongkey_" + "x" * 32) as bad:
        with pytest.raises(AuthenticationError) as exc:
            bad.jobs.list()
        assert exc.value.status == 401 and exc.value.code == "invalid_api_key"
    with client_for(service) as client:
        f = client.files.upload(chat_jsonl(), filename="t.jsonl", wait=True)
        with pytest.raises(BadRequestError) as bad_model:
            client.jobs.create(model="no-such-model", training_file=f.id)
        assert bad_model.value.param == "model" and bad_model.value.code == "invalid_model"
        with pytest.raises(BadRequestError) as bad_field:
            client.jobs.create(model=DEMO_MODEL, training_file=f.id, extra_body={"adapter": {"r": 0}})
        assert bad_field.value.param == "adapter.r"
        with pytest.raises(NotFoundError):
            client.jobs.retrieve("ftjob-doesnotexist")


def test_jobs_create_idempotent_list_control(service: Service) -> None:
    with client_for(service) as client:
        f = client.files.upload(chat_jsonl(), filename="t.jsonl", wait=True)
        job = client.jobs.create(model=DEMO_MODEL, training_file=f.id, idempotency_key="key-1",
                                 hyperparameters={"n_epochs": 2}, metadata={"team": "nlp"},
                                 adapter={"r": 4, "alpha": 8}, suffix="demo")
        again = client.jobs.create(model=DEMO_MODEL, training_file=f.id, idempotency_key="key-1",
                                   hyperparameters={"n_epochs": 2}, metadata={"team": "nlp"},
                                   adapter={"r": 4, "alpha": 8}, suffix="demo")
        assert again.id == job.id
        with pytest.raises(ConflictError) as conflict:
            client.jobs.create(model=DEMO_MODEL, training_file=f.id, idempotency_key="key-1", seed=7)
        assert conflict.value.code == "idempotency_conflict"
        assert job.status == "queued" and job.hyperparameters["n_epochs"] == 2 and job.adapter["r"] == 4
        second = client.jobs.create(model=DEMO_MODEL, training_file=f.id)  # auto idempotency key
        assert second.id != job.id
        ids = [j.id for j in client.jobs.list(limit=1)]
        assert ids == [second.id, job.id]
        assert [j.id for j in client.jobs.list(metadata={"team": "nlp"})] == [job.id]

        assert client.jobs.pause(job.id).status == "paused"
        assert client.jobs.resume(job.id).status == "queued"
        cancelled = client.jobs.cancel(job.id)
        assert cancelled.status == "cancelled" and cancelled.is_terminal
        with pytest.raises(ConflictError) as exc:
            client.jobs.cancel(job.id)
        assert exc.value.code == "invalid_state_transition"
        # Bound job objects wait and refresh through their client.
        assert job.wait(timeout=5).status == "cancelled"
        with pytest.raises(WaitTimeoutError) as timeout:
            client.jobs.wait(second.id, timeout=0.3, poll_interval=0.1)
        assert timeout.value.last.status == "queued"
        events = list(client.jobs.list_events(job.id, limit=2))
        assert events[0].message and events[0].object == "fine_tuning.job.event"
        assert any(e.type == "message" and (e.data or {}).get("to") == "paused" for e in events)


def test_running_job_outputs_stream_and_download(service: Service, tmp_path: Path) -> None:
    adapter = b"\x00safetensors" * 100
    with client_for(service) as client:
        f = client.files.upload(chat_jsonl(), filename="t.jsonl", wait=True)
        job = client.jobs.create(model=DEMO_MODEL, training_file=f.id)
        driver = JobDriver(service, job.id)
        driver.start()
        driver.write_log("step 1\nstep 2\nstep 3\n")
        driver.report(driver.metric(1, 3, 2.0), driver.metric(2, 3, 1.5))
        driver.report({"type": "checkpoint", "step": 2, "location": driver.checkpoint_location(2),
                       "metrics": {"train_loss": 1.5}})
        driver.report(driver.metric(3, 3, 1.2),
                      driver.write_outputs({"adapter/adapter_model.safetensors": adapter,
                                            "adapter/adapter_config.json": b'{"r": 8}'}))
        driver.finish("succeeded")

        final = client.jobs.wait(job.id, timeout=10, poll_interval=0.1)
        assert final.status == "succeeded" and final.fine_tuned_model
        metrics = client.jobs.metrics(job.id, limit=2)
        assert [m.step for m in metrics] == [1, 2, 3]  # three rows across two pages
        assert [m.train_loss for m in metrics] == [2.0, 1.5, 1.2]
        (ckpt,) = list(client.jobs.list_checkpoints(job.id))
        assert ckpt.step_number == 2 and ckpt.metrics["train_loss"] == 1.5
        assert client.jobs.logs(job.id).splitlines() == ["step 1", "step 2", "step 3"]

        messages = list(client.jobs.stream(job.id))
        kinds = [m.event for m in messages]
        assert kinds[-1] == "end"
        assert [m.data["step"] for m in messages if m.event == "metric"] == [1, 2, 3]
        assert [m.data["status"] for m in messages if m.event == "status"][-2:] == ["running", "succeeded"]
        # Resuming from the last id of a metric replays nothing before it.
        resumed = list(client.jobs.stream(job.id, last_event_id=messages[-2].id))
        assert [m.event for m in resumed] == ["end"]

        paths = client.jobs.download(job.id, tmp_path / "dl")
        assert sorted(p.relative_to(tmp_path / "dl").as_posix() for p in paths) == [
            "adapter/adapter_config.json", "adapter/adapter_model.safetensors"]
        assert (tmp_path / "dl/adapter/adapter_model.safetensors").read_bytes() == adapter
        with pytest.raises(ChecksumMismatchError):
            client.jobs.download_artifact(job.id, "adapter/adapter_config.json", tmp_path / "x.json",
                                          expected_sha256=hashlib.sha256(b"other").hexdigest())
        assert not (tmp_path / "x.json").exists() and not list(tmp_path.glob(".x.json*"))
        with pytest.raises(NotFoundError) as missing:
            client.jobs.download_artifact(job.id, "adapter/nope.bin", tmp_path / "nope")
        assert missing.value.code == "artifact_not_found"

        models = [m.id for m in client.models.list()]
        assert DEMO_MODEL in models and final.fine_tuned_model in models
        assert client.models.retrieve(final.fine_tuned_model).id == final.fine_tuned_model


def test_async_client(service: Service) -> None:
    async def scenario() -> None:
        async with AsyncTunefleet(base_url=service.base_url, api_key=service.key) as client:
            f = await client.files.upload(chat_jsonl(), filename="a.jsonl", wait=True)
            assert f.status == "processed"
            jobs = [await client.jobs.create(model=DEMO_MODEL, training_file=f.id) for _ in range(3)]
            page = await client.jobs.list(limit=2)
            assert [j.id async for j in page] == [j.id for j in reversed(jobs)]
            cancelled = await client.jobs.cancel(jobs[0].id)
            assert cancelled.status == "cancelled"
            assert (await jobs[0].wait(timeout=5)).status == "cancelled"
            with pytest.raises(ConflictError):
                await client.jobs.cancel(jobs[0].id)
            with pytest.raises(NotFoundError):
                await client.files.retrieve("file-missing")
            with pytest.raises(ConflictError):  # only a succeeded job's models are evaluated
                await client.jobs.evaluate(jobs[1].id, file=f.id, max_samples=2)
            assert [e async for e in await client.jobs.list_evaluations(jobs[1].id)] == []
            stream = [m.event async for m in client.jobs.stream(jobs[0].id)]
            assert stream[-1] == "end" and "status" in stream

    run_in_fresh_loop(scenario())


def test_config_precedence(service: Service, isolated_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tunefleet.sdk.config import write_config_file

    write_config_file({"base_url": service.base_url, "api_key": service.key})
    assert isolated_config.stat().st_mode & 0o777 == 0o600
    with Tunefleet() as client:  # from the file
        assert client.base_url == service.base_url
        assert client.jobs.list().data == []
    monkeypatch.setenv("TUNEFLEET_API_KEY", "tf_envkey00_" + "y" * 32)
    with Tunefleet() as client, pytest.raises(AuthenticationError):  # env beats the file
        client.jobs.list()
    with Tunefleet(api_key=service.key) as client:  # arguments beat env
        assert client.jobs.list().data == []


def test_connection_error_after_retries(isolated_config: Path) -> None:
    from tests.conftest import free_port
    from tunefleet import APIConnectionError

    with Tunefleet(base_url=f"http://127.0.0.1:{free_port()}", api_key="k", max_retries=1,
                   timeout=httpx.Timeout(2.0)) as client, pytest.raises(APIConnectionError):
        client.jobs.list()
