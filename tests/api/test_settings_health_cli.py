"""Settings refuse unsafe production values; health checks; operator CLI commands."""

from __future__ import annotations

import os
import stat

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from control.settings import Settings

SAFE = {
    "env": "production",
    "database_url": "postgresql://tf:pw@db:5432/tunefleet",
    "broker_url": "redis://redis:6379/0",
    "secret_key": "kG3v9QzL1pW7xR2tY8uN4mB6cD0fH5jS",
    "metrics_token": "kQ9vL2pW7xR3tY8uN4mB6cD1fH5jSz0A",
    "public_url": "https://tunefleet.example.com",
    "executor": "kubernetes",
}


def test_production_accepts_safe_settings() -> None:
    settings = Settings(_env_file=None, **SAFE)
    assert settings.resolved_database_url == "postgresql+psycopg://tf:pw@db:5432/tunefleet"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"database_url": None}, "TUNEFLEET_DATABASE_URL"),
        ({"database_url": "sqlite:////tmp/x.db"}, "TUNEFLEET_DATABASE_URL"),
        ({"secret_key": None}, "TUNEFLEET_SECRET_KEY"),
        ({"secret_key": "changeme"}, "TUNEFLEET_SECRET_KEY"),
        ({"broker_url": None}, "TUNEFLEET_BROKER_URL"),
        ({"broker_url": "sqla+sqlite:////tmp/b.db"}, "TUNEFLEET_BROKER_URL"),
        ({"public_url": "http://127.0.0.1:8000"}, "TUNEFLEET_PUBLIC_URL"),
        ({"admin_api_key": "short"}, "TUNEFLEET_ADMIN_API_KEY"),
    ],
)
def test_production_refuses(change: dict, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        Settings(_env_file=None, **{**SAFE, **change})


def test_development_defaults_and_env(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TUNEFLEET_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TUNEFLEET_MAX_UPLOAD_BYTES", "123")
    settings = Settings(_env_file=None)
    assert settings.resolved_database_url == f"sqlite:///{tmp_path}/tunefleet.db"
    assert settings.resolved_broker_url == f"sqla+sqlite:///{tmp_path}/broker.db"
    assert settings.resolved_artifact_url == f"{tmp_path}/artifacts"
    assert settings.max_upload_bytes == 123
    key = settings.secret_key_value()
    assert settings.secret_key_value() == key and len(key) >= 32
    assert stat.S_IMODE(os.stat(tmp_path / "secret_key").st_mode) == 0o600
    with pytest.raises(ValidationError, match="TUNEFLEET_DATABASE_URL"):
        Settings(_env_file=None, database_url="mysql://x")


def test_health(client, settings) -> None:
    from control.worker_heartbeat import beat

    assert client.get("/healthz").json() == {"status": "ok"}
    beat(settings)  # what a running worker's consumer does every 10 s
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"database": "ok", "broker": "ok", "worker": "ok"}
    assert client.get("/openapi.json").json()["info"]["title"] == "tunefleet"


def test_readyz_503_without_a_live_worker(client, settings) -> None:
    import time

    from control.worker_heartbeat import STALE_AFTER_S, beat

    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["worker"].startswith("no worker")
    beat(settings, now=time.time() - STALE_AFTER_S - 5)  # the worker stopped a while ago
    ready = client.get("/readyz")
    assert ready.status_code == 503 and "no worker heartbeat for" in ready.json()["checks"]["worker"]
    assert ready.json()["checks"]["database"] == "ok"


def test_readyz_503_when_broker_or_database_down(settings, tmp_path) -> None:
    from fastapi.testclient import TestClient

    from api.main import create_app
    from tests.conftest import make_settings

    down = make_settings(settings.data_path, database_url=settings.resolved_database_url,
                         broker_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(down, queue=None), raise_server_exceptions=False) as client:
        response = client.get("/readyz")
        assert response.status_code == 503 and response.json()["checks"]["database"] == "ok"
        assert response.json()["checks"]["broker"] != "ok"
    no_db = make_settings(tmp_path / "d2", database_url="postgresql+psycopg://nobody@127.0.0.1:1/x")
    with TestClient(create_app(no_db, queue=None), raise_server_exceptions=False) as client:
        response = client.get("/readyz")
        assert response.status_code == 503 and response.json()["checks"]["database"] != "ok"


def test_operator_cli(tmp_path, monkeypatch) -> None:
    from control.bootstrap import ensure_admin_key
    from control.settings import get_settings
    from tunefleet.cli import app

    monkeypatch.setenv("TUNEFLEET_DATA_DIR", str(tmp_path / "data"))
    for name in [k for k in os.environ if k.startswith("TUNEFLEET_") and k != "TUNEFLEET_DATA_DIR"]:
        monkeypatch.delenv(name)
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        result = runner.invoke(app, ["db", "upgrade"])
        from alembic.script import ScriptDirectory

        from control.db.migrate import MIGRATIONS_DIR

        head = ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
        assert result.exit_code == 0 and f"revision {head}" in result.output, result.output
        result = runner.invoke(app, ["admin", "create-tenant", "acme"])
        tenant_id = result.output.strip()
        assert result.exit_code == 0 and tenant_id.startswith("org-")
        assert runner.invoke(app, ["admin", "create-tenant", "acme"]).exit_code == 1
        result = runner.invoke(app, ["admin", "create-key", "--tenant", "acme"])
        key = result.output.strip()
        assert result.exit_code == 0 and key.startswith("tf_") and len(key) == 44
        assert runner.invoke(app, ["admin", "create-key", "--tenant", "nobody"]).exit_code == 1

        settings = get_settings()
        first = ensure_admin_key(settings)
        assert first is not None and ensure_admin_key(settings) is None
        key_file = settings.data_path / "admin_key"
        assert key_file.read_text().strip() == first
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600

        from fastapi.testclient import TestClient

        from api.main import create_app

        with TestClient(create_app(settings, queue=None)) as client:
            assert client.get("/v1/files", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            tenants = client.get("/v1/admin/tenants", headers={"Authorization": f"Bearer {first}"})
            assert {t["name"] for t in tenants.json()["data"]} == {"acme", "admin"}
            db = (settings.data_path / "tunefleet.db").read_bytes()
            assert first.encode() not in db and key.encode() not in db
    finally:
        get_settings.cache_clear()


def test_services_are_required_in_ci(monkeypatch) -> None:
    import tests.conftest as shared

    monkeypatch.setattr(shared, "IN_CI", True)
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        shared._unavailable("PostgreSQL on 127.0.0.1:5432", "connection refused")
    monkeypatch.setattr(shared, "IN_CI", False)
    with pytest.raises(pytest.skip.Exception):
        shared._unavailable("PostgreSQL on 127.0.0.1:5432", "connection refused")


# SQLite: a fresh copy of the migrated template has no admin tenant yet (the session's
# PostgreSQL database is shared by the tests of this process).
@pytest.mark.parametrize("backend", ["sqlite"])
def test_api_replicas_starting_together_both_start_with_one_admin_key(settings, monkeypatch, backend) -> None:
    """Two API replicas of a Deployment start on a fresh database at once: the one that
    loses the race to create the admin tenant (the other committed it between its read and
    its write) must start anyway, not exit on the unique-name check."""
    from pydantic import SecretStr

    import control.bootstrap
    from api.main import _ensure_admin_key
    from control.bootstrap import ADMIN_TENANT, ensure_admin_key
    from control.db.models import ApiKey, Tenant
    from control.db.session import session_scope

    own = settings.model_copy(update={"admin_api_key": SecretStr(f"tf_{'a' * 8}_{'b' * 32}")})
    real_create_tenant = control.bootstrap.create_tenant
    raced: list[bool] = []

    def create_tenant_after_the_other_replica(session, name, **kwargs):
        if not raced:
            raced.append(True)
            ensure_admin_key(own)  # the other replica, in its own transaction, commits first
        return real_create_tenant(session, name, **kwargs)

    monkeypatch.setattr(control.bootstrap, "create_tenant", create_tenant_after_the_other_replica)
    _ensure_admin_key(own)  # must not raise

    assert raced == [True]
    with session_scope(own.resolved_database_url) as session:
        (tenant,) = session.query(Tenant).filter(Tenant.name == ADMIN_TENANT).all()
        assert session.query(ApiKey).filter(ApiKey.tenant_id == tenant.id).count() == 1


def test_serve_gives_the_inference_worker_a_port_that_is_really_free() -> None:
    """serve binds the inference worker's socket itself: the API's port + 1 when it is free,
    another free port when something holds that one (the worker used to try to bind the
    taken port seconds later, exit, and leave the API answering inference_unavailable)."""
    import socket

    from tunefleet.cli.operator import _listen_on_loopback

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = holder.getsockname()[1]
    try:
        listener = _listen_on_loopback(taken)
        try:
            port = listener.getsockname()[1]
            assert port != taken
            socket.create_connection(("127.0.0.1", port), timeout=2).close()  # it listens
        finally:
            listener.close()
    finally:
        holder.close()
    free = _listen_on_loopback(taken)  # released: the preferred port is used
    try:
        assert free.getsockname()[1] == taken
    finally:
        free.close()
