"""End-to-end fixtures: the real service as separate processes, on real backends.

``service(backend)`` starts what ``tunefleet serve`` starts — the API (uvicorn), a Celery
worker and the scheduler loop — as three subprocesses, so a test can kill or pause one
of them (the API goes away for a while, a worker dies). ``backend`` is ``embedded``
(SQLite + kombu's server-less broker) or ``postgres`` (PostgreSQL + Redis, as in
production). The tiny base model is built once per session with ``transformers``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO, flush_redis_db, free_port, own_pg_database, stop_process_group

CLI = [sys.executable, "-c", "from tunefleet.cli import app; app()"]
ENSURE_ADMIN = [sys.executable, "-c", ("from control.settings import get_settings; "
                "from control.bootstrap import ensure_admin_key; ensure_admin_key(get_settings())")]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tiny Llama, built once (the same builder `serve --demo` uses)."""
    from tunefleet.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("models"))


@dataclass
class Service:
    base_url: str
    data_dir: Path
    env: dict[str, str]
    admin_key: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=f"{self.base_url}/v1", headers=self.headers, timeout=30.0)

    def start(self, role: str) -> None:
        commands = {
            "api": [sys.executable, "-m", "uvicorn", "--factory", "api.main:create_app",
                    "--host", "127.0.0.1", "--port", self.base_url.rsplit(":", 1)[1],
                    "--log-level", "warning"],
            "worker": [*CLI, "worker", "--concurrency=3", "--loglevel=WARNING"],
            "scheduler": [*CLI, "scheduler"],
            # Not among the roles started by default: only the completion tests need it.
            "inference": [*CLI, "inference", "--threads", "1"],
        }
        log = self.data_dir / f"{role}.log"
        self.logs[role] = log
        with log.open("ab") as fh:
            self.procs[role] = subprocess.Popen(
                commands[role], cwd=REPO, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if role == "api":
            self.wait_http()

    def stop(self, role: str, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        proc = self.procs.pop(role, None)
        if proc is not None:
            stop_process_group(proc, sig, timeout)

    def wait_http(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.procs["api"].poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"API did not start:\n{self.logs['api'].read_text()[-3000:]}")

    def dump_logs(self) -> str:
        out = []
        for role, path in self.logs.items():
            if path.exists():
                out.append(f"----- {role} -----\n{path.read_text(errors='replace')[-4000:]}")
        for trainer_log in sorted(self.data_dir.glob("jobs/*/trainer.log")):
            out.append(f"----- {trainer_log} -----\n{trainer_log.read_text(errors='replace')[-4000:]}")
        return "\n".join(out)


def _backend_env(backend: str, request: pytest.FixtureRequest, data_dir: Path,
                 cleanup: contextlib.ExitStack) -> dict[str, str]:
    if backend == "embedded":
        return {
            "TUNEFLEET_DATABASE_URL": f"sqlite:///{data_dir / 'tunefleet.db'}",
            "TUNEFLEET_BROKER_URL": f"sqla+sqlite:///{data_dir / 'broker.db'}",
        }
    # A database of the service's own: its worker re-supervises every running job and its
    # scheduler re-validates every stale file in the database, so on one shared with an
    # earlier test they would take that test's jobs (whose data dir is gone) and fill the
    # worker's slots with them while this test's tasks wait.
    pg_url = cleanup.enter_context(own_pg_database(request.getfixturevalue("pg_url"), data_dir.name.replace("-", "_")))
    redis_url = request.getfixturevalue("redis_url")
    flush_redis_db(redis_url)
    return {"TUNEFLEET_DATABASE_URL": pg_url, "TUNEFLEET_BROKER_URL": redis_url}


@pytest.fixture
def service(tmp_path: Path, tiny_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Service]]:
    """Factory: ``service(backend="embedded", **env) -> Service`` with all roles running."""
    started: list[Service] = []
    databases = contextlib.ExitStack()

    def start(backend: str = "embedded", models: dict[str, Path] | None = None,
              **extra_env: Any) -> Service:
        """``models``: more model directories to link into ``<data>/models`` (by name)."""
        data_dir = tmp_path / f"data-{len(started)}"
        (data_dir / "models").mkdir(parents=True)
        # The registry's demo model lives at <data>/models/tiny-llama: share the built one.
        os.symlink(tiny_model_dir, data_dir / "models" / "tiny-llama")
        for name, path in (models or {}).items():
            os.symlink(path, data_dir / "models" / name)
        port = free_port()
        admin_key = f"tf_{secrets.token_hex(4)}_{secrets.token_hex(16)}"
        env = {
            **os.environ,
            "TUNEFLEET_ENV": "test",
            "TUNEFLEET_DATA_DIR": str(data_dir),
            "TUNEFLEET_PUBLIC_URL": f"http://127.0.0.1:{port}",
            "TUNEFLEET_ADMIN_API_KEY": admin_key,
            "TUNEFLEET_SCHEDULE_INTERVAL_S": "0.5",
            "TUNEFLEET_STOP_GRACE_S": "20",
            # A restart waits a second here, not the default's 10 s (tests that are about the
            # backoff set their own).
            "TUNEFLEET_RESTART_BACKOFF_S": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **_backend_env(backend, request, data_dir, databases),
            **{k: str(v) for k, v in extra_env.items()},
        }
        subprocess.run([*CLI, "db", "upgrade"], cwd=REPO,
                       env=env, check=True, capture_output=True)
        subprocess.run(ENSURE_ADMIN,
                       cwd=REPO, env=env, check=True, capture_output=True)
        svc = Service(base_url=f"http://127.0.0.1:{port}", data_dir=data_dir, env=env, admin_key=admin_key)
        started.append(svc)
        for role in ("api", "worker", "scheduler"):
            svc.start(role)
        return svc

    yield start
    for svc in started:
        for role in list(svc.procs):
            svc.stop(role)
        if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
            print(svc.dump_logs())
    databases.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
