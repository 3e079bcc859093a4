"""A Redis restart while an ``acks_late`` task runs: the worker reconnects and keeps working.

Celery 5.7.0 died here ("Unrecoverable error: AttributeError('NoneType' object has no
attribute 'hostname')" from kombu's ``restore_unacked``) every time, because the running
task's message is unacknowledged. This test owns a throwaway ``redis-server`` on a free
port (never the shared one) and restarts it under a real worker.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, _unavailable, free_port, make_settings, settings_env

pytestmark = pytest.mark.redis

REDIS_SERVER = shutil.which("redis-server")


def until(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


class ThrowawayRedis:
    """A ``redis-server`` without persistence on ``port``, stopped and started at will."""

    def __init__(self, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        until(answers, 10, f"redis-server on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[ThrowawayRedis]:
    if REDIS_SERVER is None:
        _unavailable("redis-server (the binary, for a throwaway instance)", "not installed")
    server = ThrowawayRedis(free_port(), tmp_path / "redis.log")
    server.start()
    yield server
    server.stop()


def test_the_worker_survives_a_redis_restart_with_a_task_in_flight(
    redis_server: ThrowawayRedis, tmp_path: Path, sqlite_template: Path
) -> None:
    from control.worker_heartbeat import last_beat
    from worker.celery_app import make_celery

    data = tmp_path / "data"
    data.mkdir()
    shutil.copyfile(sqlite_template, data / "tunefleet.db")
    settings = make_settings(data, broker_url=f"redis://127.0.0.1:{redis_server.port}/0")
    log_path = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.faults.slow_tasks", "worker",
         "--pool", "threads", "--concurrency", "2", "--loglevel", "INFO",
         "--without-gossip", "--without-mingle"],
        cwd=REPO, env=settings_env(settings), stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
    )
    client = make_celery(settings)
    try:
        until(lambda: last_beat(settings) is not None, 30, "the worker's first heartbeat")
        held, after = tmp_path / "held", tmp_path / "after"
        client.send_task("tests.faults.hold", args=[30, str(held)])
        until(held.exists, 30, "the long task to start")

        redis_server.stop()
        time.sleep(1.0)  # the worker sees the connection drop while the task runs
        restarted_at = time.time()
        redis_server.start()

        client.send_task("tests.faults.touch", args=[str(after)])
        until(after.exists, 45, f"a task sent after the restart to run:\n{log_path.read_text()}")
        assert worker.poll() is None, log_path.read_text()
        assert "Unrecoverable error" not in log_path.read_text()
        # Redis came back empty: the restarted consumer beats again at once.
        until(lambda: (last_beat(settings) or 0) >= restarted_at, 15, "a heartbeat after it")
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGQUIT)  # immediate shutdown: the held task is abandoned
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
