"""SDK/CLI suite fixtures: the real API app served by uvicorn on a free port.

``service`` starts ``api.main.create_app`` on SQLite AND on PostgreSQL (``backend`` and
``settings`` are the API suite's: a migrated SQLite copy, or the session's PostgreSQL
database migrated by Alembic), with file validation run inline by the suite's queue, and
gives a tenant key. A module that does not need both backends parametrizes ``backend``
itself. ``empty_pg_url`` is an empty PostgreSQL database of the test's own, for the
operator commands that migrate it and for a test that runs a Celery worker (whose
scheduler must see that test's jobs only). PostgreSQL or Redis missing: skipped locally,
a failure under ``CI=true`` (tests/conftest.py).

Jobs are moved the way the real system moves them: ``JobDriver`` plays the scheduler
(``control.jobs.lifecycle.transition`` to ``running`` with a job token) and the trainer (report
batches POSTed to the internal report endpoint with that token), then the executor
(``succeeded``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import backend, settings  # noqa: F401 (fixtures: sqlite and postgres)
from tests.conftest import own_pg_database

DEMO_MODEL = "tunefleet-tiny-llama"


def terminal_width(monkeypatch: pytest.MonkeyPatch, columns: int) -> None:
    """The CLI's consoles ``columns`` wide. rich fixes a console's width when the console is
    built while COLUMNS is set (the CLI builds its consoles once, at import, under whatever
    test imports it first in the process), so setting COLUMNS alone is not enough."""
    from tunefleet.cli import render

    monkeypatch.setenv("COLUMNS", str(columns))
    for console in (render.console, render.err_console):
        monkeypatch.setattr(console, "width", columns)


@pytest.fixture
def cli(service: Service, isolated_config: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """``cli(*args, code=0, input=None)``: run a ``tunefleet`` command against ``service``
    (its URL and key in the environment, 200 columns wide) and check its exit code."""
    from typer.testing import CliRunner

    from tunefleet.cli import app

    for name, value in service.env.items():
        monkeypatch.setenv(name, value)
    terminal_width(monkeypatch, 200)
    runner = CliRunner()

    def run(*args: str, code: int = 0, input: str | None = None) -> Any:
        result = runner.invoke(app, list(args), input=input, catch_exceptions=False)
        assert result.exit_code == code, (args, result.exit_code, result.stdout, result.stderr)
        return result

    return run


def chat_jsonl(n: int = 6) -> bytes:
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{2 * i}"}]} for i in range(n)]
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


BAD_JSONL = (
    b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    b'{"messages": [{"role": "wizard", "content": "hi"}]}\n'
    b"not json\n"
)


def queued_job(service: Service) -> str:
    """The id of a new job of the demo model on a small validated chat file (it waits in
    the queue until a ``JobDriver`` moves it)."""
    from tunefleet import Tunefleet

    with Tunefleet(base_url=service.base_url, api_key=service.key) as client:
        fid = client.files.upload(chat_jsonl(), filename="t.jsonl", wait=True).id
        return client.jobs.create(model=DEMO_MODEL, training_file=fid).id


@dataclass
class Service:
    base_url: str
    key: str
    tenant_id: str
    settings: Any

    @property
    def env(self) -> dict[str, str]:
        return {"TUNEFLEET_BASE_URL": self.base_url, "TUNEFLEET_API_KEY": self.key}


@dataclass
class JobDriver:
    """Moves a job through running -> reports -> a final status, like the real parts do."""

    service: Service
    job_id: str
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    seq: int = 0

    def start(self, pool: str = "local", gpus: int = 1, throughput: dict[str, float] | None = None) -> None:
        """``throughput``: the MFU basis admission stores (``job.estimate["throughput"]``)."""
        from control.db.session import session_scope
        from control.ids import hash_secret
        from control.jobs.lifecycle import lock_job, transition

        with session_scope(self.service.settings.resolved_database_url) as session:
            job = lock_job(session, self.job_id)
            assert job is not None
            estimate = {"estimate": {**(job.estimate or {}), "throughput": throughput}} if throughput else {}
            transition(session, job, "running", actor="scheduler", pool=pool, gpus=gpus,
                       job_token_hash=hash_secret(self.token), **estimate)

    def report(self, *items: dict[str, Any]) -> dict[str, Any]:
        self.seq += 1
        response = httpx.post(
            f"{self.service.base_url}/internal/v1/jobs/{self.job_id}/reports",
            json={"seq": self.seq, "items": list(items)},
            headers={"Authorization": f"Bearer {self.token}"}, timeout=10,
        )
        response.raise_for_status()
        return response.json()

    def metric(self, step: int, total: int, loss: float, tokens_per_s: float = 1000.0) -> dict[str, Any]:
        return {"type": "metric", "step": step, "total_steps": total, "epoch": 0, "train_loss": loss,
                "learning_rate": 1e-4, "grad_norm": 0.5, "tokens_per_s": tokens_per_s,
                "tokens_seen": step * 256, "time": 1.7e9 + step}

    def write_outputs(self, files: dict[str, bytes]) -> dict[str, Any]:
        """Write output files under the job's dir; returns the ``artifacts`` report item."""
        out = self.service.settings.data_path / "artifacts" / self.job_id / "output"
        listing = []
        for name, data in files.items():
            path = out / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            listing.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        return {"type": "artifacts", "location": str(out), "files": listing}

    def checkpoint_location(self, step: int) -> str:
        """Where the local trainer of this job keeps checkpoint ``step`` (its token may
        register nothing else)."""
        return str(self.service.settings.job_dir(self.job_id) / "checkpoints" / f"step-{step}")

    def write_log(self, text: str) -> None:
        path = self.service.settings.data_path / "jobs" / self.job_id / "trainer.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def finish(self, status: str = "succeeded") -> None:
        from control.db.session import session_scope
        from control.jobs.lifecycle import lock_job, transition

        with session_scope(self.service.settings.resolved_database_url) as session:
            job = lock_job(session, self.job_id)
            assert job is not None
            transition(session, job, status, actor="executor")


@pytest.fixture
def service(app: Any, live_server: Callable[[Any], str], tenant_key: Any,
            settings: Any) -> Service:  # noqa: F811 (the imported fixture)
    base_url = live_server(app)
    tk = tenant_key()
    return Service(base_url=base_url, key=tk.key, tenant_id=tk.tenant_id, settings=settings)


@pytest.fixture
def empty_pg_url(pg_url: str) -> Iterator[str]:
    """A new, empty PostgreSQL database next to the session's one (dropped afterwards)."""
    with own_pg_database(pg_url, "own") as url:
        yield url


@contextlib.contextmanager
def cached_settings_env(monkeypatch: pytest.MonkeyPatch, prefix: str,
                        get_settings: Any) -> Iterator[Callable[..., None]]:
    """``set_env(key=value, ...)`` sets ``{prefix}KEY`` for this process and clears the
    ``functools.cache`` of ``get_settings`` (settings are read once), so the next read
    sees it; the cache is cleared on the way in and out too, so no test sees another's."""

    def set_env(**values: str) -> None:
        for key, value in values.items():
            monkeypatch.setenv(f"{prefix}{key.upper()}", value)
        get_settings.cache_clear()

    get_settings.cache_clear()
    try:
        yield set_env
    finally:
        get_settings.cache_clear()


@pytest.fixture
def isolated_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No user config or env leaks into a test; returns the config file path to use."""
    for name in ("TUNEFLEET_BASE_URL", "TUNEFLEET_API_KEY", "TUNEFLEET_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "cfg" / "config.toml"
    monkeypatch.setenv("TUNEFLEET_CONFIG", str(path))
    return path


def run_in_fresh_loop(coro):
    """``asyncio.run(coro)`` on a thread of its own: an event loop another test left running
    in the main thread (Playwright's sync API keeps one) cannot get in the way."""
    import asyncio
    import threading

    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            result["error"] = exc

    thread = threading.Thread(target=target, name="async-test")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result.get("value")
