"""The CLI on the production stack: PostgreSQL, a Redis broker and a real Celery worker.

An operator migrates an empty PostgreSQL database and makes a tenant and key with the
operator commands; the service runs with its real task queue (``CeleryQueue`` on Redis,
no inline validation), and a ``celery worker`` process validates uploads and runs the
scheduling cycles. The user's commands then see the worker's results: the upload is
validated by it, the job is queued and the scheduler's reason for not placing it (it asks
for more GPUs than the local pool has) shows up; cancelling ends the job.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from typer.testing import CliRunner

from tests.conftest import make_settings, settings_env
from tests.model_files import install_demo_model
from tests.sdk.conftest import BAD_JSONL, DEMO_MODEL, chat_jsonl
from tunefleet.cli import app


def test_cli_flow_with_redis_broker_and_celery_worker(
    empty_pg_url: str, redis_url: str, celery_worker: Callable[[Any], Any], live_server: Callable[[Any], str],
    isolated_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from api.main import create_app
    from control.settings import get_settings

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    settings = make_settings(data_dir, database_url=empty_pg_url, broker_url=redis_url)
    install_demo_model(settings.models_dir)  # a service has the files of the models it lists
    for name in [k for k in os.environ if k.startswith("TUNEFLEET_") and k != "TUNEFLEET_CONFIG"]:
        monkeypatch.delenv(name)
    for name, value in settings_env(settings).items():
        if name.startswith("TUNEFLEET_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("COLUMNS", "200")
    get_settings.cache_clear()
    runner = CliRunner()

    def cli(*args: str, code: int = 0) -> Any:
        result = runner.invoke(app, list(args), catch_exceptions=False)
        assert result.exit_code == code, (args, result.exit_code, result.stdout, result.stderr)
        return result

    def js(*args: str, code: int = 0) -> Any:
        return json.loads(cli(*args, code=code).stdout)

    try:
        assert js("db", "upgrade", "--json")["revision"]
        tenant = js("admin", "create-tenant", "ml-platform", "--json")
        key = js("admin", "create-key", "--tenant", tenant["id"], "--json")["key"]
    finally:
        get_settings.cache_clear()

    worker = celery_worker(settings)
    try:
        _user_commands(js, worker, tmp_path, base_url=live_server(create_app(settings)), key=key,
                  monkeypatch=monkeypatch)
    finally:
        # Warm shutdown, then drop what is left on the session's broker (the cancel's
        # `tunefleet.schedule`, say): another test's worker must not run it on its database.
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
        broker = redis.Redis.from_url(redis_url)
        broker.flushdb()
        broker.close()
    log = (tmp_path / "celery-0.log").read_text()
    assert "Traceback" not in log, log


def _user_commands(js: Callable[..., Any], worker: Any, tmp_path: Path, *, base_url: str, key: str,
              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEFLEET_BASE_URL", base_url)  # the app sends tasks through Redis
    monkeypatch.setenv("TUNEFLEET_API_KEY", key)
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_bytes(chat_jsonl(4))
    bad.write_bytes(BAD_JSONL)
    uploaded = js("files", "upload", str(good), "--timeout", "60", "--json")
    assert uploaded["status"] == "processed" and uploaded["validation"]["n_examples"] == 4
    rejected = js("files", "upload", str(bad), "--timeout", "60", "--json", code=3)
    assert (2, "unrecognized_role") in {(e["line"], e["code"]) for e in rejected["validation"]["errors"]}

    # No pool holds 64 GPUs: such a job is refused at creation unless it asks to wait anyway.
    wait_anyway = tmp_path / "body.json"
    wait_anyway.write_text(json.dumps({"placement": {"queue_if_unfit": True}}), encoding="utf-8")
    job = js("jobs", "create", "-m", DEMO_MODEL, "-t", uploaded["id"], "--gpus", "64",
             "--body", str(wait_anyway), "--json")
    assert job["status"] in ("validating_files", "queued") and job["queue_reason"] is None
    deadline = time.monotonic() + 60
    while not (seen := js("jobs", "get", job["id"], "--json"))["queue_reason"]:
        assert time.monotonic() < deadline and worker.poll() is None, ("no scheduling cycle ran", seen)
        time.sleep(0.3)
    # Only the scheduler (here: the worker's `tunefleet.schedule` task) writes the reason.
    assert seen["status"] == "queued" and "at most 1 GPUs per job" in seen["queue_reason"], seen

    assert js("jobs", "cancel", job["id"], "--json")["status"] == "cancelled"
    assert [j["id"] for j in js("jobs", "list", "--status", "cancelled", "--json")["data"]] == [job["id"]]
    assert js("jobs", "wait", job["id"], "--timeout", "5", "--json", code=3)["status"] == "cancelled"
    assert worker.poll() is None
