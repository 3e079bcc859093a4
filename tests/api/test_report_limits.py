"""Trainer reports are bounded: per report, per job, per transaction; an outcome is final.

The probes: one report of 10,000 metric items blocked other tenants' writes for 14-17 s
on SQLite; a job token could store ~8 MB of events per report, 600 reports a minute; and
within the token's grace after ``succeeded`` an ``error`` item still rewrote the
succeeded job's ``error``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from control.db.models import Artifact, Job, JobEvent, JobMetric
from control.jobs.lifecycle import transition
from tests.api.conftest import chat_lines, start_running
from tests.conftest import make_settings

# Another tenant's write while a big report is ingested: it waits for at most one of the
# report's transactions, not the whole report (a loaded 2-core machine: seconds, not 14).
NEIGHBOUR_BOUND_S = 3.0


@pytest.fixture
def backend() -> str:
    return "sqlite"  # SQLite's one write lock is what a long report transaction holds


def metric(step: int, total: int = 10_000) -> dict[str, Any]:
    return {"type": "metric", "step": step, "total_steps": total, "train_loss": 2.0,
            "tokens_seen": 64 * step, "learning_rate": 1e-4}


def event(message: str = "x") -> dict[str, Any]:
    return {"type": "event", "level": "info", "message": message}


@pytest.fixture
def tuned_app(settings, inline_queue):
    """``make(**settings)``: the app with those settings on the test's database."""
    from api.main import create_app

    def make(**overrides: Any):
        tuned = make_settings(settings.data_path, database_url=settings.resolved_database_url, **overrides)
        return create_app(tuned, queue=inline_queue)

    return make


@pytest.fixture
def running(client, tenant_key, make_job, db_session) -> dict[str, Any]:
    owner = tenant_key()
    job = make_job(owner.headers)
    _, token = start_running(db_session, job["id"])
    return {"id": job["id"], "token": token, "headers": owner.headers,
            "path": f"/internal/v1/jobs/{job['id']}/reports", "auth": {"Authorization": f"Bearer {token}"}}


def stored(db_session, model: Any, job_id: str) -> int:
    db_session.expire_all()
    return db_session.query(model).filter(model.job_id == job_id).count()


def test_a_report_over_the_item_cap_is_refused_before_any_write(client, running, db_session) -> None:
    answer = client.post(running["path"], headers=running["auth"],
                         json={"seq": 1, "items": [metric(s) for s in range(10_000)]})
    assert answer.status_code == 413, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("report_too_large", "items")
    assert "1000" in error["message"]
    assert stored(db_session, JobMetric, running["id"]) == 0


def test_a_report_over_the_byte_cap_is_refused(client, running, db_session) -> None:
    events_before = stored(db_session, JobEvent, running["id"])
    # ~1.2 MB of events in 300 items: under the item cap, over the byte cap.
    answer = client.post(running["path"], headers=running["auth"],
                         json={"seq": 1, "items": [event("e" * 4000) for _ in range(300)]})
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["code"] == "report_too_large"
    assert stored(db_session, JobEvent, running["id"]) == events_before


def test_past_the_jobs_quota_metrics_and_events_are_dropped_and_the_outcome_still_lands(
        tuned_app, running, db_session, settings) -> None:
    from fastapi.testclient import TestClient

    output = f"{settings.resolved_artifact_url}/{running['id']}/output"
    with TestClient(tuned_app(report_max_items_per_job=5)) as client:
        first = client.post(running["path"], headers=running["auth"],
                            json={"seq": 1, "items": [event(f"e{n}") for n in range(8)]})
        assert first.status_code == 200, first.text
        second = client.post(running["path"], headers=running["auth"], json={"seq": 2, "items": [
            metric(1), {"type": "artifacts", "location": output, "files": [
                {"name": "adapter/adapter_model.safetensors", "bytes": 1, "sha256": "a" * 64}]},
            {"type": "error", "code": "nan_loss", "message": "loss is NaN"}]})
        assert second.status_code == 200, second.text
    messages = [e.message for e in db_session.query(JobEvent).filter(JobEvent.job_id == running["id"])
                .order_by(JobEvent.seq)]
    assert [m for m in messages if m.startswith("e")] == [f"e{n}" for n in range(5)]
    assert sum("quota" in m for m in messages) == 1, messages  # said once, not per dropped item
    assert stored(db_session, JobMetric, running["id"]) == 0
    # What decides the job's outcome is never dropped.
    assert stored(db_session, Artifact, running["id"]) == 1
    assert db_session.get_one(Job, running["id"]).error["code"] == "nan_loss"


def test_another_tenants_write_is_not_held_up_by_a_big_report(
        tuned_app, running, live_server, tenant_key, monkeypatch) -> None:
    from control.reports import ingest

    items = 2000
    app = tuned_app(report_max_items=items, report_max_bytes=8 * 1024 * 1024)
    base = live_server(app)
    started, finished = threading.Event(), threading.Event()
    real_check = ingest.check_batch_locations  # the first step of applying a batch

    def announced_check(*args: Any, **kwargs: Any) -> Any:
        started.set()
        return real_check(*args, **kwargs)

    monkeypatch.setattr(ingest, "check_batch_locations", announced_check)
    answers: list[httpx.Response] = []

    def post_big_report() -> None:
        try:
            answers.append(httpx.post(f"{base}{running['path']}", headers=running["auth"], timeout=120,
                                      json={"seq": 1, "items": [metric(s, items) for s in range(items)]}))
        finally:
            finished.set()

    neighbour = tenant_key()
    reporter = threading.Thread(target=post_big_report)
    reporter.start()
    assert started.wait(60), "the report never reached ingestion"
    waits: list[float] = []
    with httpx.Client(base_url=base, headers=neighbour.headers, timeout=60) as other:
        while not finished.is_set():
            began = time.monotonic()
            answer = other.post("/v1/files", data={"purpose": "fine-tune"},
                                files={"file": ("t.jsonl", chat_lines(2), "application/jsonl")})
            assert answer.status_code == 200, answer.text
            waits.append(time.monotonic() - began)
    reporter.join()
    assert answers and answers[0].status_code == 200, answers
    assert waits, "no write of the other tenant overlapped the report"
    assert max(waits) < NEIGHBOUR_BOUND_S, f"another tenant's writes waited {max(waits):.1f} s ({waits})"


def test_an_error_after_success_changes_nothing_of_the_outcome(client, running, db_session, settings) -> None:
    output = f"{settings.resolved_artifact_url}/{running['id']}/output"
    adapter = {"name": "adapter/adapter_model.safetensors", "bytes": 10, "sha256": "a" * 64}
    assert client.post(running["path"], headers=running["auth"], json={"seq": 1, "items": [
        metric(4, 4), {"type": "artifacts", "location": output, "files": [adapter]}]}).status_code == 200
    row = db_session.get_one(Job, running["id"])
    transition(db_session, row, "succeeded", actor="executor")
    db_session.commit()
    before = client.get(f"/v1/fine_tuning/jobs/{running['id']}", headers=running["headers"]).json()

    # Within the token's grace (60 s after it stopped running) the trainer still reports.
    late = client.post(running["path"], headers=running["auth"], json={"seq": 2, "items": [
        {"type": "error", "code": "nan_loss", "message": "rewritten"},
        metric(9, 9) | {"tokens_seen": 10**9},
        {"type": "artifacts", "location": output, "files": [adapter | {"sha256": "b" * 64}]},
        event("late but kept")]})
    assert late.status_code == 200, late.text
    after = client.get(f"/v1/fine_tuning/jobs/{running['id']}", headers=running["headers"]).json()
    for field in ("status", "error", "fine_tuned_model", "trained_tokens", "finished_at", "result_files"):
        assert after[field] == before[field], field
    db_session.expire_all()
    assert db_session.query(Artifact).filter(Artifact.job_id == running["id"]).one().sha256 == "a" * 64
    events = [e.message for e in db_session.query(JobEvent).filter(JobEvent.job_id == running["id"])]
    assert "late but kept" in events
    assert any("after the job succeeded" in m and "nan_loss" in m for m in events), events


def test_a_batch_cut_off_between_two_transactions_is_completed_by_its_retry(
        client, running, db_session, monkeypatch) -> None:
    from control.reports import ingest

    monkeypatch.setattr(ingest, "REPORT_CHUNK_ITEMS", 3)
    real_apply_items = ingest._apply_items
    calls = 0

    def crash_on_the_second_chunk(*args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("the API process died here")
        real_apply_items(*args, **kwargs)

    monkeypatch.setattr(ingest, "_apply_items", crash_on_the_second_chunk)
    batch = {"seq": 1, "items": [event(f"n{n}") for n in range(8)]}
    assert client.post(running["path"], headers=running["auth"], json=batch).status_code == 500

    def messages() -> list[str]:
        db_session.expire_all()
        return [e.message for e in db_session.query(JobEvent).order_by(JobEvent.seq)
                .filter(JobEvent.job_id == running["id"], JobEvent.message.like("n%"))]

    assert messages() == ["n0", "n1", "n2"]  # the first transaction committed
    retried = client.post(running["path"], headers=running["auth"], json=batch)
    assert retried.json() == {"acked_seq": 1, "duplicate": False}
    again = client.post(running["path"], headers=running["auth"], json=batch)
    assert again.json() == {"acked_seq": 1, "duplicate": True}
    assert messages() == [f"n{n}" for n in range(8)]  # each item exactly once


def test_the_trainers_reporter_stays_under_the_default_caps(app, running, live_server, db_session,
                                                            tmp_path) -> None:
    """Large events (4,000 characters each: ~2 MB in 500 items) go out in several reports,
    each under the service's default caps: a real trainer never meets a 413."""
    from trainers.common.reporter import Reporter

    base = live_server(app)
    reporter = Reporter(url=f"{base}{running['path']}", token=running["token"], spool_dir=tmp_path / "spool",
                        flush_interval_s=60)
    for n in range(500):
        reporter.event(f"{n:04d}" + "e" * 3996)
    assert reporter.close(timeout_s=60), reporter.rejected
    assert reporter.rejected is None
    assert reporter.sent_batches >= 4
    db_session.expire_all()
    assert db_session.query(JobEvent).filter(JobEvent.job_id == running["id"],
                                             JobEvent.message.like("%eeee")).count() == 500
