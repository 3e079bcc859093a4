"""The lifecycle rules, table-tested, and what one transition writes."""

from __future__ import annotations

import itertools
import time

import pytest
from sqlalchemy import select

from control.db.models import JOB_STATUSES, Job, JobEvent
from control.errors import APIError
from control.jobs import lifecycle

ACTORS = ("user", "admin", "scheduler", "executor", "trainer", "system")
PEOPLE = {"user", "admin"}

# Who may move a job from which status to which, written out by hand independently of
# control.jobs.lifecycle.RULES: a change to the rules has to be made in both places.
ALLOWED: dict[tuple[str, str], set[str]] = {
    ("validating_files", "queued"): {"system"},
    ("validating_files", "failed"): {"system"},
    ("validating_files", "cancelled"): PEOPLE | {"system"},
    # executor / trainer: a launch admitted while Kueue held it starts, or never does
    ("queued", "running"): {"scheduler", "executor", "trainer"},
    ("queued", "queued"): {"scheduler", "executor", "system"},
    ("queued", "failed"): {"scheduler", "executor", "system"},
    ("queued", "paused"): PEOPLE | {"system"},
    ("queued", "cancelled"): PEOPLE | {"system"},
    ("running", "queued"): {"scheduler", "executor", "system"},
    ("running", "succeeded"): {"executor", "trainer"},
    ("running", "failed"): {"executor", "trainer", "system"},
    ("running", "paused"): PEOPLE | {"system"},
    ("running", "cancelled"): PEOPLE | {"system"},
    ("paused", "queued"): PEOPLE | {"system"},
    ("paused", "cancelled"): PEOPLE | {"system"},
}


@pytest.mark.parametrize(
    ("from_status", "to"), list(itertools.product(JOB_STATUSES, JOB_STATUSES))
)
def test_rules_table(from_status: str, to: str) -> None:
    for actor in ACTORS:
        allowed = actor in ALLOWED.get((from_status, to), set())
        if allowed:
            assert lifecycle.check_transition(from_status, to, actor).to == to
        else:
            with pytest.raises(APIError) as caught:
                lifecycle.check_transition(from_status, to, actor)
            assert caught.value.status == 409
            assert caught.value.code == "invalid_state_transition"
            assert from_status in caught.value.message and to in caught.value.message


def test_terminal_states_never_change() -> None:
    for status in ("succeeded", "failed", "cancelled"):
        for to, actor in itertools.product(JOB_STATUSES, ACTORS):
            with pytest.raises(APIError, match="no longer changes"):
                lifecycle.check_transition(status, to, actor)


def _job(db_session, tenant_key, make_job) -> Job:
    headers = tenant_key().headers
    return db_session.get_one(Job, make_job(headers)["id"])


def test_transition_writes_row_event_and_calls_hooks(db_session, tenant_key, make_job) -> None:
    job = _job(db_session, tenant_key, make_job)
    assert job.status == "queued"
    seen: list[tuple[str, str, str, str]] = []

    def hook(session, hooked_job, from_status, to, actor) -> None:
        assert session is db_session
        seen.append((hooked_job.id, from_status, to, actor))

    lifecycle.register_transition_hook(hook)
    try:
        event = lifecycle.transition(db_session, job, "running", actor="scheduler",
                                     message="placed on local", pool="local", gpus=1)
        db_session.commit()
    finally:
        lifecycle.unregister_transition_hook(hook)
    assert seen == [(job.id, "queued", "running", "scheduler")]
    db_session.expire_all()
    stored = db_session.get_one(Job, job.id)
    assert (stored.status, stored.pool, stored.gpus) == ("running", "local", 1)
    assert stored.started_at is not None and stored.finished_at is None
    row = db_session.scalar(select(JobEvent).where(JobEvent.id == event.id))
    assert row.type == "status" and row.message == "placed on local"
    assert row.data == {"from": "queued", "to": "running", "actor": "scheduler"}

    lifecycle.transition(db_session, stored, "failed", actor="trainer",
                         error={"code": "nan_loss", "message": "loss became NaN"})
    db_session.commit()
    assert stored.finished_at is not None
    last = db_session.scalar(
        select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.seq.desc())
    )
    assert last.level == "error"


def test_failing_hook_rolls_back_the_transition(db_session, tenant_key, make_job) -> None:
    job = _job(db_session, tenant_key, make_job)
    n_events = len(db_session.scalars(select(JobEvent).where(JobEvent.job_id == job.id)).all())

    def broken(*_args) -> None:
        raise RuntimeError("webhook outbox full")

    lifecycle.register_transition_hook(broken)
    try:
        with pytest.raises(RuntimeError):
            lifecycle.transition(db_session, job, "running", actor="scheduler")
        db_session.rollback()
    finally:
        lifecycle.unregister_transition_hook(broken)
    db_session.expire_all()
    assert db_session.get_one(Job, job.id).status == "queued"
    assert len(db_session.scalars(select(JobEvent).where(JobEvent.job_id == job.id)).all()) == n_events


def test_status_is_not_a_change(db_session, tenant_key, make_job) -> None:
    job = _job(db_session, tenant_key, make_job)
    with pytest.raises(TypeError):
        lifecycle.transition(db_session, job, "running", actor="scheduler", status="succeeded")


def test_lock_job_makes_read_then_write_atomic(settings, tenant_key, make_job) -> None:
    """Two admissions of the same queued job: the second waits for the first and sees it running.

    On SQLite this needs ``BEGIN IMMEDIATE`` (pysqlite would otherwise let both read
    ``queued``); on PostgreSQL, ``FOR UPDATE``.
    """
    import threading

    from control.db.session import session_scope

    job_id = make_job(tenant_key().headers)["id"]
    url = settings.resolved_database_url
    first_locked, seen = threading.Event(), []

    def admit(first: bool) -> None:
        with session_scope(url) as session:
            job = lifecycle.lock_job(session, job_id)
            if first:
                first_locked.set()
                time.sleep(0.5)  # hold the lock while the other one tries
            seen.append(job.status)
            if job.status == "queued":
                lifecycle.transition(session, job, "running", actor="scheduler")

    a = threading.Thread(target=admit, args=(True,))
    a.start()
    assert first_locked.wait(10)
    b = threading.Thread(target=admit, args=(False,))
    b.start()
    a.join(20)
    b.join(20)
    assert seen == ["queued", "running"]
