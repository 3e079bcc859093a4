"""Operator commands (`tunefleet db`, `tunefleet admin`) with --json, on SQLite and PostgreSQL.

Each test starts from an empty database (a new SQLite file, or a new PostgreSQL database)
configured through ``TUNEFLEET_*`` variables, the way an operator runs them. The JSON
objects must be the ones the admin API answers for the same rows. A last test walks the
whole command tree: every command takes ``--json`` except the named exceptions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.sdk.conftest import cached_settings_env
from tunefleet.cli import app


@pytest.fixture
def operator_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Only the given ``TUNEFLEET_*`` variables (plus a fresh data dir) reach the commands."""
    from control.settings import get_settings

    for name in [k for k in os.environ if k.startswith("TUNEFLEET_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TUNEFLEET_DATA_DIR", str(tmp_path / "data"))
    with cached_settings_env(monkeypatch, "TUNEFLEET_", get_settings) as set_env:
        yield set_env


def operator(*args: str, code: int = 0) -> Any:
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == code, (args, result.exit_code, result.stdout, result.stderr)
    return result


def js(result: Any) -> Any:
    return json.loads(result.stdout)


def test_db_and_admin_commands_print_json(backend: str, operator_env: Callable[..., None],
                                          request: pytest.FixtureRequest) -> None:
    from alembic.script import ScriptDirectory
    from fastapi.testclient import TestClient

    from api.main import create_app
    from control.db.migrate import MIGRATIONS_DIR
    from control.settings import get_settings

    if backend == "postgres":
        operator_env(database_url=request.getfixturevalue("empty_pg_url"))
    else:
        operator_env()

    head = ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
    assert js(operator("db", "upgrade", "--json")) == {"object": "database", "revision": head}
    assert js(operator("admin", "list-tenants", "--json")) == {"object": "list", "data": [], "has_more": False}

    acme = js(operator("admin", "create-tenant", "acme", "--json"))
    assert acme["id"].startswith("org-") and acme["object"] == "organization"
    assert (acme["name"], acme["is_admin"]) == ("acme", False) and isinstance(acme["created_at"], int)
    again = operator("admin", "create-tenant", "acme", "--json", code=1)
    assert json.loads(again.stderr)["error"] == {
        "message": "A tenant named 'acme' already exists.", "code": "tenant_exists", "param": "name"}
    ops = js(operator("admin", "create-tenant", "ops", "--admin", "--json"))
    assert ops["is_admin"] is True

    key = js(operator("admin", "create-key", "--tenant", "acme", "--name", "ci", "--json"))
    assert key["key"].startswith("tf_") and len(key["key"]) == 44 and key["key"][3:11] == key["prefix"]
    assert (key["object"], key["tenant_id"], key["name"], key["is_admin"], key["revoked_at"]) == (
        "api_key", acme["id"], "ci", False, None)
    admin_key = js(operator("admin", "create-key", "--tenant", ops["id"], "--admin", "--json"))
    assert admin_key["is_admin"] is True and admin_key["tenant_id"] == ops["id"]
    missing = operator("admin", "create-key", "--tenant", "nobody", "--json", code=1)
    assert json.loads(missing.stderr)["error"]["code"] == "not_found" and missing.stdout == ""

    listed = js(operator("admin", "list-tenants", "--json"))
    assert [t["name"] for t in listed["data"]] == ["acme", "ops"] and listed["has_more"] is False
    human = operator("admin", "list-tenants").stdout.splitlines()
    assert human == [f"{acme['id']}\tacme\t", f"{ops['id']}\tops\tadmin"]

    # The same rows through the admin API: the CLI prints the API's objects; the keys work.
    with TestClient(create_app(get_settings(), queue=None)) as client:
        api_view = client.get("/v1/admin/tenants", headers={"Authorization": f"Bearer {admin_key['key']}"})
        assert api_view.status_code == 200 and api_view.json()["data"] == listed["data"]
        assert client.get("/v1/files", headers={"Authorization": f"Bearer {key['key']}"}).status_code == 200


def test_invalid_configuration_is_a_json_error(operator_env: Callable[..., None]) -> None:
    operator_env(database_url="mysql://nobody@db/x")
    result = operator("admin", "list-tenants", "--json", code=2)
    error = json.loads(result.stderr)["error"]
    assert error["code"] == "invalid_configuration" and "TUNEFLEET_DATABASE_URL" in error["message"]
    assert result.stdout == ""


# Long-running processes and raw file bytes have no JSON document to print.
NO_JSON = {"serve", "worker", "scheduler", "inference", "files content"}


def test_every_command_but_processes_and_raw_bytes_takes_json() -> None:
    import typer.main

    def commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
        for name in group.list_commands(None):
            command = group.get_command(None, name)
            if hasattr(command, "list_commands"):
                yield from commands(command, (*path, name))
            else:
                yield " ".join((*path, name)), command

    found = dict(commands(typer.main.get_command(app)))
    assert {"db upgrade", "admin create-tenant", "admin create-key", "admin list-tenants", "jobs watch"} <= set(found)
    without = {name for name, command in found.items()
               if not any("--json" in getattr(param, "opts", ()) for param in command.params)}
    assert without == NO_JSON
