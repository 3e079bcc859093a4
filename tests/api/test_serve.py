"""``tunefleet serve``: one command starts API + worker + scheduler, prints an admin key,
builds the demo model it lists, validates an upload through its own worker, answers a
completion on that model through its inference worker, and stops every child on SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, free_port


@pytest.fixture
def backend() -> str:  # serve always runs the embedded defaults
    return "sqlite"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True,
                         check=False)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True,
                           check=False)
    return bool(state.stdout.strip()) and not state.stdout.strip().startswith("Z")


def _child(pid: int, role: str) -> int | None:
    """The child of ``pid`` running the ``role`` command (``worker``, ``scheduler``, ``inference``)."""
    for child in _children(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if role.encode() in argv:
            return child
    return None


def _worker_killed_mid_stream_is_restarted(serve_pid: int, base: str, headers: dict[str, str],
                                           log_path: Path) -> None:
    """kill -9 the inference worker while a client streams: the stream ends with an error
    event and [DONE] (no hang), serve restarts the worker, and the tenant's next request
    (its only slot given back) is answered once the new worker has loaded the model."""
    worker = _child(serve_pid, "inference")
    assert worker is not None
    body = {"model": "tunefleet-tiny-llama", "prompt": "hi", "max_tokens": 400, "n": 16, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", headers=headers, json=body, timeout=60) as stream:
        assert stream.status_code == 200
        lines = (line for line in stream.iter_lines() if line.startswith("data: "))
        assert '"text_completion"' in next(lines)
        os.kill(worker, signal.SIGKILL)
        rest = list(lines)
    assert rest[-1] == "data: [DONE]" and '"code":"inference_unavailable"' in rest[-2], rest[-3:]
    _wait_for(lambda: f"inference worker (pid {worker}) exited with signal 9; restarting" in log_path.read_text())
    again = httpx.post(f"{base}/v1/completions", headers=headers, timeout=300,
                       json={"model": "tunefleet-tiny-llama", "prompt": "hi", "max_tokens": 2})
    assert again.status_code == 200, again.text  # held while the new worker starts and loads the model
    assert _child(serve_pid, "inference") not in (None, worker)


@pytest.mark.slow
def test_serve_starts_everything_and_stops_on_sigterm(tmp_path) -> None:
    port = free_port()
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEFLEET_")}
    env["OMP_NUM_THREADS"] = "1"
    env["TUNEFLEET_INFERENCE_MAX_CONCURRENT_PER_TENANT"] = "1"  # a slot not given back shows as a 429
    log_path = tmp_path / "serve.log"
    log = log_path.open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from tunefleet.cli import app; app()", "serve", "--port", str(port),
         "--data-dir", str(data), "--worker-concurrency", "1"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # the first start builds the demo model (torch import)
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.3)
        key = (data / "admin_key").read_text().strip()
        assert stat.S_IMODE(os.stat(data / "admin_key").st_mode) == 0o600
        assert key in log_path.read_text()  # printed once at first start
        headers = {"Authorization": f"Bearer {key}"}
        line = b'{"prompt": "2+2", "completion": "4"}\n'
        file = httpx.post(f"{base}/v1/files", headers=headers, data={"purpose": "fine-tune"},
                          files={"file": ("t.jsonl", line * 3)}).json()
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/v1/files/{file['id']}", headers=headers).json()["status"] != (
                "processed"):
            assert time.monotonic() < deadline, "the embedded worker did not validate the file"
            time.sleep(0.3)
        assert httpx.get(f"{base}/readyz").json()["status"] == "ok"
        # serve built the files of the model it lists (without --demo) ...
        model_dir = data / "models" / "tiny-llama"
        assert (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()
        assert f"base model tunefleet-tiny-llama: {model_dir}" in log_path.read_text()
        # ... and the inference worker answers the API over its channel (the secret both
        # derive) with a completion of that model.
        deadline = time.monotonic() + 120
        while (done := httpx.post(f"{base}/v1/completions", headers=headers, timeout=60, json={
                "model": "tunefleet-tiny-llama", "prompt": "hi", "max_tokens": 2})).status_code != 200:
            assert done.json()["error"]["code"] in ("inference_unavailable", "model_loading"), done.text
            assert time.monotonic() < deadline, "the inference worker did not come up"
            time.sleep(0.5)
        assert done.json()["model"] == "tunefleet-tiny-llama" and done.json()["usage"]["completion_tokens"] >= 1
        _worker_killed_mid_stream_is_restarted(proc.pid, base, headers, log_path)
        celery = _child(proc.pid, "worker")
        os.kill(celery, signal.SIGKILL)  # any child that exits is started again
        _wait_for(lambda: f"worker (pid {celery}) exited with signal 9; restarting" in log_path.read_text())
        _wait_for(lambda: _child(proc.pid, "worker") not in (None, celery))
        children = _children(proc.pid)
        assert children, "no worker/scheduler subprocesses"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(c) for c in children)


# ---- the supervisor that keeps serve's children running --------------------------------

SLEEPER = [sys.executable, "-c", ("from tunefleet.cli.supervise import die_with_parent; die_with_parent(); "
           "import time; time.sleep(120)")]


def _wait_for(predicate, timeout: float = 30.0) -> None:
    """Another thread (the supervisor's) changes what ``predicate`` reads; nothing to await."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_child_that_exits_is_restarted_after_a_growing_backoff_and_logged(caplog) -> None:
    from tunefleet.cli.supervise import ChildSpec, Supervisor

    caplog.set_level(logging.WARNING, logger="tunefleet.serve")
    supervisor = Supervisor([ChildSpec("sleeper", SLEEPER)], backoff_s=0.5, check_interval_s=0.05)
    supervisor.start()
    try:
        first = supervisor.pids()["sleeper"][0]
        os.kill(first, signal.SIGKILL)
        _wait_for(lambda: len(supervisor.pids()["sleeper"]) == 2)
        second = supervisor.pids()["sleeper"][1]
        killed_at = time.monotonic()
        os.kill(second, signal.SIGKILL)
        _wait_for(lambda: len(supervisor.pids()["sleeper"]) == 3)
        assert time.monotonic() - killed_at >= 1.0  # the second restart waits twice as long
        third = supervisor.pids()["sleeper"][2]
        assert _alive(third)
    finally:
        supervisor.stop(grace_s=5)
    assert not _alive(third)
    logged = [r.getMessage() for r in caplog.records]
    assert logged == [f"sleeper (pid {first}) exited with signal 9; restarting it in 0 s (restart 1)",
                      f"sleeper (pid {second}) exited with signal 9; restarting it in 1 s (restart 2)"]


def test_a_child_that_stops_answering_its_health_check_is_killed_and_restarted(caplog) -> None:
    from tunefleet.cli.supervise import ChildSpec, Supervisor

    caplog.set_level(logging.WARNING, logger="tunefleet.serve")
    answers = iter([True])  # healthy once, then stuck
    supervisor = Supervisor([ChildSpec("worker", SLEEPER, healthy=lambda: next(answers, False))],
                            backoff_s=0.1, check_interval_s=0.05, probe_interval_s=0.05, probe_failures=3)
    supervisor.start()
    try:
        _wait_for(lambda: len(supervisor.pids()["worker"]) == 2)
    finally:
        supervisor.stop(grace_s=5)
    stuck = supervisor.pids()["worker"][0]
    assert not _alive(stuck)
    assert [r.getMessage() for r in caplog.records][:2] == [
        f"worker (pid {stuck}) failed 3 health checks in a row; killing it",
        f"worker (pid {stuck}) exited with signal 9; restarting it in 0 s (restart 1)"]


def test_children_die_with_a_supervisor_killed_by_sigkill() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", ("import sys, time; from tunefleet.cli.supervise import ChildSpec, Supervisor; "
         f"s = Supervisor([ChildSpec('sleeper', {SLEEPER!r})]); s.start(); "
         "print(s.pids()['sleeper'][0], flush=True); time.sleep(120)")],
        cwd=REPO, stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.kill()  # before or after the child asked for its parent's death signal: it ends either way
    parent.wait()
    _wait_for(lambda: not _alive(child), timeout=60)


def test_the_inference_probe_fails_on_a_stalled_model_and_on_no_answer(live_server) -> None:
    from inference.server import create_app as worker_app
    from tests.inference.scripted import ScriptedEngine
    from tunefleet.cli.operator import _inference_probe

    class Stalled(ScriptedEngine):
        stalled = 0.0

        def stalled_s(self) -> float:
            return self.stalled

    engine, secret = Stalled(), "p" * 32
    url = live_server(worker_app(engine, secret, stall_limit_s=60))
    assert _inference_probe(url, secret)()
    engine.stalled = 61.0  # a generation holds its model without a token for longer than the limit
    assert not _inference_probe(url, secret)()
    assert not _inference_probe(url, "q" * 32)()  # a worker that refuses the probe
    assert not _inference_probe(f"http://127.0.0.1:{free_port()}", secret)()  # nobody listens
