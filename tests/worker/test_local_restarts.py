"""The local executor's two ways of ending a trainer that will not end well by itself.

- A trainer that crashes on every attempt is restarted ``max_restarts`` times, then the
  job fails with ``trainer_crashed`` (and says so in an event).
- A trainer that ignores SIGTERM is killed with SIGKILL once the grace period is over.

The trainer is a stand-in interpreter (``supervise_trainer(python=...)`` runs it as
``<python> -m trainers --spec <spec>``); the job transitions go through the real task
code (``worker.executors.local.supervisor.finish``) on the test database.
"""

import signal
import sys
import time
from pathlib import Path

import pytest

from control.db.models import Job
from control.jobs.lifecycle import transition
from tests.api.conftest import make_job, processed_file, upload  # noqa: F401 (fixtures)
from trainers.exit_codes import ExitCode
from worker.executors.local.process import supervise_trainer
from worker.executors.local.supervisor import finish


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


def test_restarts_wait_out_the_backoff_and_a_stop_during_it_starts_no_new_trainer(tmp_path) -> None:
    """The supervisor restarts a crashed trainer after ``restart_delay(n)`` seconds, still
    heartbeating; a cancel or pause while it waits ends the supervision at once."""
    crashing = stand_in(tmp_path, "#!/bin/sh\nexit 1\n")
    events: list[str] = []
    starts: list[float] = []
    delays = {1: 0.4, 2: 0.8}
    outcome = supervise(tmp_path, crashing, should_stop=lambda: False, max_restarts=2,
                        restart_delay=delays.__getitem__, heartbeat_path=tmp_path / "heartbeat",
                        on_event=lambda level, msg: events.append(msg),
                        on_restart=lambda n: starts.append(time.monotonic()))
    assert outcome.history == [ExitCode.INTERNAL_ERROR] * 3 and not outcome.stopped
    assert "restarting from the latest checkpoint in 0.4 s (restart 1/2)" in events[0], events
    assert "in 0.8 s (restart 2/2)" in events[1], events
    # the second restart came at least its own delay after the first one was announced
    assert starts[1] - starts[0] >= delays[1]

    stop_requested: list[bool] = []
    began = time.monotonic()
    outcome = supervise(tmp_path, crashing, should_stop=lambda: bool(stop_requested), max_restarts=2,
                        restart_delay=lambda n: 600.0, on_restart=lambda n: stop_requested.append(True))
    assert outcome.stopped and outcome.history == [ExitCode.INTERNAL_ERROR] and outcome.restarts == 1
    assert time.monotonic() - began < 60  # it did not sit out the 10-minute backoff


@pytest.mark.parametrize(("crash", "returncode", "described"), [
    ('echo "attempt $$"; exit 1', ExitCode.INTERNAL_ERROR, "exit 1 (INTERNAL_ERROR)"),
    ('echo "attempt $$"; kill -9 $$', -signal.SIGKILL, "killed by SIGKILL"),
])
def test_a_trainer_that_always_crashes_fails_the_job_after_max_restarts(
    tmp_path, client, tenant_key, make_job, db_session, settings, crash, returncode, described,  # noqa: F811
) -> None:
    tenant = tenant_key()
    job = make_job(tenant.headers)
    row = db_session.get_one(Job, job["id"])
    transition(db_session, row, "running", actor="scheduler")
    db_session.commit()

    events: list[tuple[str, str]] = []
    restarts: list[int] = []
    outcome = supervise(tmp_path, stand_in(tmp_path, f"#!/bin/sh\n{crash}\n"), should_stop=lambda: False,
                        max_restarts=2, on_event=lambda level, msg: events.append((level, msg)),
                        on_restart=restarts.append)

    assert outcome.history == [returncode] * 3  # the first attempt and 2 restarts
    assert outcome.restarts == 2 and restarts == [1, 2]
    assert [level for level, _ in events] == ["warn", "warn"]
    assert described in events[0][1] and "restart 2/2" in events[1][1]
    assert len((tmp_path / "trainer.log").read_text().splitlines()) == 3  # every attempt ran
    assert outcome.error is not None and outcome.error["code"] == "trainer_crashed"
    assert described in outcome.error["message"] and "max_restarts=2" in outcome.error["message"]

    status = finish(settings, job["id"], str(tmp_path), outcome, None)
    assert status == "failed"
    failed = client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=tenant.headers).json()
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "trainer_crashed"
    assert "max_restarts=2" in failed["error"]["message"]
    messages = [e["message"] for e in client.get(f"/v1/fine_tuning/jobs/{job['id']}/events",
                                                 headers=tenant.headers).json()["data"]]
    assert any(m.startswith("Job failed: trainer_crashed") for m in messages), messages


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

    outcome = supervise(tmp_path, python, should_stop=should_stop, grace_s=grace_s, max_restarts=2)
    waited = time.monotonic() - stop_asked[0]

    assert outcome.stopped and outcome.history == [returncode]  # a stopped trainer is not restarted
    assert outcome.returncode == returncode
    if ignore:
        assert waited >= grace_s, f"SIGKILL came {waited:.2f}s after SIGTERM, before the {grace_s}s grace"
    assert not (tmp_path / "trainer.pid").exists()
