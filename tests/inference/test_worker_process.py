"""The inference worker as its own process (``python -m inference``) on the tiny model:
callers that go away leave nothing running, another tenant is answered meanwhile, an
idle worker uses no CPU, and SIGTERM ends open streams cleanly and the process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inference.protocol import GENERATE_PATH, HEALTH_PATH, SECRET_HEADER
from tests.conftest import REPO, free_port

SECRET = "w" * 32
HEADERS = {SECRET_HEADER: SECRET}
ANSWER_BOUND_S = 5.0  # another tenant's 2-token request, once the abandoned streams are gone


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    url: str
    model: str

    def body(self, tenant: str, **sampling: object) -> dict[str, object]:
        return {"base": {"id": "tiny", "path": self.model}, "prompt": "hi", "tenant": tenant,
                "load_wait_s": 60, "sampling": {"max_tokens": 2, **sampling}}

    def health(self) -> dict[str, object]:
        return httpx.get(self.url + HEALTH_PATH, headers=HEADERS, timeout=5).json()


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (``/proc/<pid>/stat``, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    port = free_port()
    log = (tmp_path_factory.mktemp("worker") / "worker.log").open("wb")
    env = {**os.environ, "TUNEFLEET_INFERENCE_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "inference", "--port", str(port), "--threads", "1"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    running = Worker(proc, f"http://127.0.0.1:{port}", str(tiny_model_dir))
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(running.url + HEALTH_PATH, headers=HEADERS, timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.2)
    # The first request waits for the model to load (load_wait_s) instead of a 503.
    loaded = httpx.post(running.url + GENERATE_PATH, headers=HEADERS, json=running.body("warm-up"), timeout=60)
    assert loaded.status_code == 200 and '"finish"' in loaded.text, loaded.text
    yield running
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


def _abandon(worker: Worker, started: threading.Barrier) -> None:
    """A hostile caller: 16 choices of up to 480 tokens, gone after its first tokens."""
    with httpx.stream("POST", worker.url + GENERATE_PATH, headers=HEADERS, timeout=30,
                      json=worker.body("hog", n=16, max_tokens=480, temperature=1.0)) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert json.loads(next(lines))["type"] == "start"
        started.wait(30)


def test_abandoned_streams_leave_nothing_running_and_another_tenant_is_answered(worker: Worker) -> None:
    started = threading.Barrier(5)
    callers = [threading.Thread(target=_abandon, args=(worker, started)) for _ in range(4)]
    for caller in callers:
        caller.start()
    started.wait(60)  # all four generate; now they disconnect
    for caller in callers:
        caller.join(30)
    gone_at = time.monotonic()
    other = httpx.post(worker.url + GENERATE_PATH, headers=HEADERS, json=worker.body("other"), timeout=30)
    answered_s = time.monotonic() - gone_at
    assert other.status_code == 200 and json.loads(other.text.splitlines()[-1])["completion_tokens"] == 2
    assert answered_s < ANSWER_BOUND_S, answered_s
    deadline = time.monotonic() + ANSWER_BOUND_S
    while (status := worker.health())["generations"] != 0:  # another process: nothing to wait on but this
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


def test_an_idle_worker_uses_no_cpu(worker: Worker) -> None:
    before = cpu_seconds(worker.proc.pid)
    time.sleep(3.0)  # the measurement itself: CPU time spent over 3 s of wall time
    used = cpu_seconds(worker.proc.pid) - before
    assert used < 0.15, f"{used:.2f} CPU s in 3 s while idle"


def test_sigterm_ends_open_streams_with_an_error_and_the_worker_exits(worker: Worker) -> None:
    with httpx.stream("POST", worker.url + GENERATE_PATH, headers=HEADERS, timeout=30,
                      json=worker.body("late", n=16, max_tokens=480, temperature=1.0)) as response:
        lines = response.iter_lines()
        assert json.loads(next(lines))["type"] == "start"
        worker.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        events = [json.loads(line) for line in lines if line.strip()]
    assert events[-1]["type"] == "error" and events[-1]["code"] == "worker_stopping", events[-1]
    # uvicorn restores the default handler and raises the signal again once it has shut down.
    assert worker.proc.wait(timeout=15) in (0, -signal.SIGTERM)
    assert time.monotonic() - signalled < 15
