"""An embedded `tunefleet serve` for the benches that time jobs end to end over HTTP.

`embedded_service` starts the service with the embedded defaults (SQLite, server-less
broker, local executor) in a fresh data dir, with the demo model already built (as
`serve --demo` does before it submits), and stops it on exit; `upload_jsonl` uploads a
training file and waits until validation has processed it. Neither is timed by the
benches: a user's service is already running and their file already uploaded.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tunefleet.demo import ensure_demo_model

T = TypeVar("T")


@dataclass(frozen=True)
class EmbeddedService:
    """A running embedded service: its URL, its admin client and where it keeps its data."""

    base_url: str
    http: httpx.Client  # base URL .../v1, authenticated with the admin key
    data_dir: Path
    model_dir: Path  # the demo model's checkpoint directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], T], timeout: float, what: str, *, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy (returned), else TimeoutError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(what)


def get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def embedded_service(
    extra_env: Mapping[str, str] | None = None, *, models: Mapping[str, Path] | None = None,
    start_timeout: float = 120,
) -> Iterator[EmbeddedService]:
    """Start `tunefleet serve` in a fresh data dir; yield it once /healthz answers; stop it.

    Args:
        extra_env: settings on top of the embedded defaults (``TUNEFLEET_*`` variables).
        models: prepared model folders copied into the data dir's models folder under the
            given names before the service starts (its registry lists what is there then).
        start_timeout: seconds the API may take to answer.
    """
    data_dir = Path(tempfile.mkdtemp(prefix="tf-bench-"))
    port = free_port()
    key = f"tf_{secrets.token_hex(4)}_{secrets.token_hex(16)}"
    env = {**os.environ, "TUNEFLEET_DATA_DIR": str(data_dir), "TUNEFLEET_ADMIN_API_KEY": key,
           "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    model_dir = ensure_demo_model(data_dir / "models")  # built once before timing, as `serve --demo` does
    for name, path in (models or {}).items():
        shutil.copytree(path, data_dir / "models" / name)
    log = (data_dir / "serve.log").open("wb")
    serve = subprocess.Popen(
        [sys.executable, "-c", "from tunefleet.cli import app; app()", "serve", "--port", str(port)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: serve.poll() is not None or get_ok(f"{base}/healthz"), start_timeout, "the API")
        if serve.poll() is not None:
            raise RuntimeError(f"tunefleet serve exited with {serve.returncode}; see {data_dir / 'serve.log'}")
        with httpx.Client(base_url=f"{base}/v1", headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
            yield EmbeddedService(base, http, data_dir, model_dir)
    finally:
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
        log.close()


def upload_jsonl(http: httpx.Client, rows: list[dict[str, Any]], name: str = "train.jsonl",
                 timeout: float = 60) -> str:
    """Upload ``rows`` as a fine-tune file and wait until it is processed; return its id."""
    body = "".join(json.dumps(row) + "\n" for row in rows).encode()
    upload = http.post("/files", data={"purpose": "fine-tune"}, files={"file": (name, body, "application/jsonl")})
    upload.raise_for_status()
    file_id = upload.json()["id"]

    def processed() -> bool:
        status = http.get(f"/files/{file_id}").json()["status"]
        if status == "error":
            raise RuntimeError(f"file {file_id} failed validation")
        return status == "processed"

    wait_for(processed, timeout, "validation")
    return file_id
