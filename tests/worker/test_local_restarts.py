"""The local executor's two ways of ending a trainer that will not end well by itself.

- A crashed trainer is not restarted by its supervisor: the run ends as a lost run
  (REQUEUE) through the one outcome path (``worker.outcomes.apply_outcome``), which
  requeues the job from its checkpoint after the restart backoff, as the next attempt;
  one that crashes on every attempt fails the job with ``trainer_crashed`` after
  ``max_restarts`` restarts (and says so in an event).
- A trainer that ignores SIGTERM is killed with SIGKILL once the grace period is over.

The trainer is a stand-in interpreter (``supervise_trainer(python=...)`` runs it as
``<python> -m trainers --spec <spec>``); the job transitions go through the real task
code (``worker.executors.local.supervisor.finish``) and the scheduler's store
(``DbStore``, which admits each next attempt) on the test database.
"""

import signal
import sys
import time
from pathlib import Path

import pytest

from control.db.models import Job
from control.db.session import session_scope
from scheduling.pools import local_pool
from tests.api.conftest import make_job, processed_file, upload  # noqa: F401 (fixtures)
from tests.worker.test_db_store import Clock, RecordingExecutor, _tiny_config
from trainers.exit_codes import ExitCode
from worker.executors.base import ObservedKind
from worker.executors.local.process import supervise_trainer
from worker.executors.local.supervisor import finish, observed_change
from worker.scheduler.cycle import run_cycle
from worker.scheduler.store import DbStore


def stand_in(tmp_path: Path, body: str) -> str:
    """An executable that the supervisor starts in place of the Python interpreter."""
    path = tmp_path / "python"
    path.write_text(body)
    path.chmod(0o755)
    return str(path)


def supervise(tmp_path: Path, python: str, **kwargs):
    spec = tmp_path / "spec.json"
    spec.write_text('{"trainer": "fsdp_qlora"}')
    return supervise_trainer(spec, log_path=tmp_path / "trainer.log",
                             termination_path=tmp_path / "termination.json", pid_path=tmp_path / "trainer.pid",
                             python=python, poll_s=0.05, **kwargs)


def _row(settings, job_id: str) -> Job:
    with session_scope(settings.resolved_database_url) as session:
        job = session.get_one(Job, job_id)
        session.expunge(job)
        return job


@pytest.mark.parametrize(("crash", "returncode", "described"), [
    ('echo "attempt $$"; exit 1', ExitCode.INTERNAL_ERROR, "exit 1 (INTERNAL_ERROR)"),
    ('echo "attempt $$"; kill -9 $$', -signal.SIGKILL, "killed by SIGKILL"),
])
def test_a_trainer_that_always_crashes_is_requeued_with_backoff_then_fails_after_max_restarts(
    tmp_path, client, tenant_key, make_job, settings, crash, returncode, described,  # noqa: F811
) -> None:
    _tiny_config(settings)
    settings = settings.model_copy(update={"max_restarts": 2, "restart_backoff_s": 10.0,
                                           "restart_backoff_max_s": 15.0})
    tenant = tenant_key()
    job_id = make_job(tenant.headers)["id"]
    pools = [local_pool(slots=1)]
    clock = Clock(time.time())  # finish() stamps the backoff with the real time
    store, ex = DbStore(settings, pools, clock=clock), RecordingExecutor(pools)
    run_cycle(store, ex, clock=clock)
    crashing = stand_in(tmp_path, f"#!/bin/sh\n{crash}\n")

    for attempt, delay in ((1, 10.0), (2, 15.0), (3, None)):  # 20 s capped at 15 s; then no restart left
        row = _row(settings, job_id)
        assert (row.status, row.attempt, len(ex.launches)) == ("running", attempt, attempt)
        outcome = supervise(tmp_path, crashing, should_stop=lambda: False)
        # One trainer per supervision: the supervisor never restarts it itself.
        assert len((tmp_path / "trainer.log").read_text().splitlines()) == attempt
        assert (outcome.returncode, outcome.stopped, outcome.crashed) == (returncode, False, True)
        status = finish(settings, job_id, str(tmp_path), outcome, None, attempt=attempt)
        ex.running.clear()
        row = _row(settings, job_id)
        assert row.exited_attempt == attempt
        if delay is None:
            assert status == "failed" and row.restarts == 2
            break
        # Requeued from its checkpoint as a lost run, one restart more, after the backoff.
        assert (status, row.restarts) == ("queued", attempt)
        not_before = row.restart_not_before.timestamp()
        assert abs(not_before - (time.time() + delay)) < 5, (not_before, delay)
        clock.t = not_before - 1
        run_cycle(store, ex, clock=clock)
        waiting = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=tenant.headers).json()
        assert waiting["status"] == "queued" and len(ex.launches) == attempt, waiting
        assert waiting["queue_reason"].startswith(f"waiting: restart {attempt} starts at "), waiting
        clock.t = not_before + 1
        run_cycle(store, ex, clock=clock)  # admitted again: the next attempt

    failed = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=tenant.headers).json()
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "trainer_crashed"
    assert described in failed["error"]["message"] and "max_restarts=2" in failed["error"]["message"]
    messages = [e["message"] for e in client.get(f"/v1/fine_tuning/jobs/{job_id}/events",
                                                 params={"limit": 100}, headers=tenant.headers).json()["data"]]
    assert any(f"trainer {described} (restart 1 of 2); resumes from the start in 10 s." in m
               for m in messages), messages
    assert any(f"trainer {described} (restart 2 of 2)" in m for m in messages), messages
    assert any(m.startswith(f"Job failed: trainer_crashed: trainer {described} (gave up after 2 restarts)")
               for m in messages), messages


def test_a_crash_with_a_termination_message_keeps_the_trainers_code(tmp_path) -> None:
    """An internal error the trainer described itself: its code and message go with the lost run."""
    termination = tmp_path / "termination.json"
    crashing = stand_in(tmp_path, "#!/bin/sh\n"
                                  f"echo '{{\"code\": \"internal_error\", \"message\": \"boom\"}}' > {termination}\n"
                                  "exit 1\n")
    outcome = supervise(tmp_path, crashing, should_stop=lambda: False)
    change = observed_change("ftjob-x", 1, outcome, None)
    assert (change.kind, change.error_code, change.exit_code) == (ObservedKind.REQUEUE, "internal_error", 1)
    assert change.message == "trainer exit 1 (INTERNAL_ERROR): boom"


@pytest.mark.parametrize("returncode", [ExitCode.USER_ERROR, ExitCode.OUT_OF_MEMORY, ExitCode.SUCCESS])
def test_exits_the_trainer_chose_are_not_lost_runs(tmp_path, returncode) -> None:
    outcome = supervise(tmp_path, stand_in(tmp_path, f"#!/bin/sh\nexit {int(returncode)}\n"),
                        should_stop=lambda: False)
    assert outcome.returncode == returncode and not outcome.crashed and not outcome.stopped


# The stand-in records that it started, then sleeps; "ignore" makes it immune to SIGTERM.
SLEEPER = """#!{python}
import signal, sys, time
from pathlib import Path
if {ignore}:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
Path({ready!r}).write_text("up")
time.sleep(120)
"""


@pytest.mark.parametrize(("ignore", "returncode"), [(True, -signal.SIGKILL), (False, -signal.SIGTERM)])
def test_a_trainer_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path, ignore, returncode) -> None:
    ready = tmp_path / "ready"
    python = stand_in(tmp_path, SLEEPER.format(python=sys.executable, ignore=ignore, ready=str(ready)))
    grace_s = 1.5
    stop_asked: list[float] = []

    def should_stop() -> bool:
        if ready.exists() and not stop_asked:
            stop_asked.append(time.monotonic())
        return bool(stop_asked)

    outcome = supervise(tmp_path, python, should_stop=should_stop, grace_s=grace_s)
    waited = time.monotonic() - stop_asked[0]

    assert outcome.stopped and not outcome.crashed  # a stopped trainer is no lost run
    assert outcome.returncode == returncode
    if ignore:
        assert waited >= grace_s, f"SIGKILL came {waited:.2f}s after SIGTERM, before the {grace_s}s grace"
    assert not (tmp_path / "trainer.pid").exists()
