"""A job token reports only while its job runs (plus a short grace for the last batch).

The probe: after the job succeeded, its token still posted events and overwrote ``error``.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select, update

from control.db.models import Job, JobEvent
from control.jobs.lifecycle import transition
from tests.api.conftest import start_running

JOBS = "/v1/fine_tuning/jobs"


def _age_last_status_change(db_session, job_id: str, seconds: float) -> None:
    """Move the job's last status change ``seconds`` into the past (instead of waiting)."""
    last = db_session.scalar(select(JobEvent.seq).where(JobEvent.job_id == job_id, JobEvent.type == "status")
                             .order_by(JobEvent.seq.desc()).limit(1))
    created = db_session.scalar(select(JobEvent.created_at).where(JobEvent.seq == last))
    db_session.execute(update(JobEvent).where(JobEvent.seq == last)
                       .values(created_at=created - dt.timedelta(seconds=seconds)))
    db_session.commit()


def test_a_finished_jobs_token_stops_reporting_after_the_grace(client, tenant_key, make_job, db_session) -> None:
    tenant = tenant_key()
    job_id = make_job(tenant.headers)["id"]
    row, token = start_running(db_session, job_id)

    def post(seq: int, *items: dict):
        return client.post(f"/internal/v1/jobs/{job_id}/reports", json={"seq": seq, "items": list(items)},
                           headers={"Authorization": f"Bearer {token}"})

    assert post(0, {"type": "event", "message": "step 1"}).status_code == 200
    db_session.refresh(row)
    transition(db_session, row, "succeeded", actor="executor")
    db_session.commit()
    # The trainer exported its adapter and is still flushing: its last batch is accepted.
    assert post(1, {"type": "event", "message": "final flush"}).status_code == 200

    _age_last_status_change(db_session, job_id, 61)
    forged = post(2, {"type": "event", "message": "forged"},
                  {"type": "error", "code": "nan_loss", "message": "forged error"})
    assert forged.status_code == 401
    assert forged.json()["error"]["code"] == "job_token_expired"
    job = client.get(f"{JOBS}/{job_id}", headers=tenant.headers).json()
    assert job["status"] == "succeeded" and job["error"] is None
    messages = [e["message"] for e in client.get(f"{JOBS}/{job_id}/events?limit=100",
                                                 headers=tenant.headers).json()["data"]]
    assert "final flush" in messages and "forged" not in messages


def test_a_preempted_jobs_old_token_expires_and_never_reports_while_queued(
        client, tenant_key, make_job, db_session) -> None:
    tenant = tenant_key()
    job_id = make_job(tenant.headers)["id"]
    row, token = start_running(db_session, job_id)
    db_session.refresh(row)
    transition(db_session, row, "queued", actor="scheduler")
    db_session.commit()
    _age_last_status_change(db_session, job_id, 61)
    response = client.post(f"/internal/v1/jobs/{job_id}/reports",
                           json={"seq": 0, "items": [{"type": "event", "message": "late"}]},
                           headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "job_token_expired"
    assert db_session.get_one(Job, job_id).status == "queued"


def test_a_stopping_run_reports_its_final_checkpoint_until_its_outcome(
        client, tenant_key, make_job, db_session) -> None:
    """Paused and at once resumed: the old trainer is still checkpointing when the job is
    queued again, and it may report until its run's outcome is recorded (exited_attempt),
    then only for the short grace."""
    tenant = tenant_key()
    job_id = make_job(tenant.headers)["id"]
    row, token = start_running(db_session, job_id)
    db_session.refresh(row)
    row.attempt = 1  # admitted once; no outcome of that run yet
    transition(db_session, row, "paused", actor="user")
    transition(db_session, row, "queued", actor="user")
    db_session.commit()

    def post(seq: int) -> int:
        return client.post(f"/internal/v1/jobs/{job_id}/reports",
                           json={"seq": seq, "items": [{"type": "event", "message": f"late {seq}"}]},
                           headers={"Authorization": f"Bearer {token}"}).status_code

    last = db_session.scalar(select(JobEvent.seq).where(JobEvent.job_id == job_id, JobEvent.type == "status")
                             .order_by(JobEvent.seq.desc()).limit(1))
    for seq in (last, last - 1):  # both status changes, the pause and the resume, 2 minutes ago
        created = db_session.scalar(select(JobEvent.created_at).where(JobEvent.seq == seq))
        db_session.execute(update(JobEvent).where(JobEvent.seq == seq)
                           .values(created_at=created - dt.timedelta(seconds=120)))
    db_session.commit()
    assert post(1) == 200
    db_session.execute(update(Job).where(Job.id == job_id).values(exited_attempt=1))
    db_session.commit()
    assert post(2) == 401
