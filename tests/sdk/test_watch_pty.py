"""`tunefleet jobs watch` in a real pseudo-terminal while a job trains.

The watcher runs as its own process on a pty (so rich renders its live progress bar
the way a user sees it) while the test plays scheduler/trainer/executor through the
real service. The captured screen must show the steps, tokens/s, loss, ETA, the
events as they come, and the final status; the exit code follows the job's outcome.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from tests.sdk.conftest import JobDriver, Service, queued_job

# Rendering does not depend on the database: one backend is enough here.
pytestmark = pytest.mark.parametrize("backend", ["sqlite"])

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


def run_in_pty(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    os.close(master)
    return code, b"".join(chunks).decode("utf-8", errors="replace")


def test_watch_shows_live_progress_and_final_status(service: Service) -> None:
    job_id = queued_job(service)
    driver = JobDriver(service, job_id)
    driver.start()
    driver.report(driver.metric(1, 4, 2.75, tokens_per_s=1500.0))

    def train() -> None:
        time.sleep(1.5)  # let the watcher attach first
        for step, loss in ((2, 2.25), (3, 1.875), (4, 1.5)):
            driver.report(driver.metric(step, 4, loss, tokens_per_s=1500.0 + step))
            time.sleep(0.3)
        driver.report({"type": "event", "level": "info", "message": "exported the adapter", "data": {}})
        time.sleep(0.3)
        driver.finish("succeeded")

    trainer = threading.Thread(target=train)
    trainer.start()
    env = {**os.environ, **service.env, "TERM": "xterm-256color", "OMP_NUM_THREADS": "1"}
    env.pop("COLUMNS", None)
    code, screen = run_in_pty(
        [sys.executable, "-c", "from tunefleet.cli import app; app()", "jobs", "watch", job_id], env, timeout=60
    )
    trainer.join()
    text = ANSI.sub("", screen)
    assert code == 0, text
    assert "step 4/4" in text and "100%" in text
    assert "1,504 tok/s" in text and "loss 1.5000" in text
    assert re.search(r"ETA \d+:\d\d", text)
    assert "[info] exported the adapter" in text
    assert f"{job_id} succeeded" in text
    assert "\x1b[" in screen  # it really drew a live terminal display, not plain lines


def test_watch_of_a_failed_job_exits_3(service: Service) -> None:
    job_id = queued_job(service)
    driver = JobDriver(service, job_id)
    driver.start()
    driver.report({"type": "error", "code": "nan_loss", "message": "loss became NaN at step 3"})
    driver.finish("failed")
    env = {**os.environ, **service.env, "TERM": "xterm-256color"}
    code, screen = run_in_pty(
        [sys.executable, "-c", "from tunefleet.cli import app; app()", "jobs", "watch", job_id], env, timeout=60
    )
    text = ANSI.sub("", screen)
    assert code == 3, text
    assert f"{job_id} failed: loss became NaN at step 3" in text
