"""``tunefleet serve``: one command starts API + worker + scheduler, prints an admin key,
builds the demo model it lists, validates an upload through its own worker, answers a
completion on that model through its inference worker, and stops every child on SIGTERM."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

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


@pytest.mark.slow
def test_serve_starts_everything_and_stops_on_sigterm(tmp_path) -> None:
    port = free_port()
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEFLEET_")}
    env["OMP_NUM_THREADS"] = "1"
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
        children = _children(proc.pid)
        assert children, "no worker/scheduler subprocesses"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(c) for c in children)
