"""API suite fixtures: every test here runs on SQLite AND on PostgreSQL (``backend``).

``settings`` is overridden with a ``backend`` parameter: ``sqlite`` (a migrated copy of
the template) or ``postgres`` (the session's Alembic-migrated database; tests isolate
by tenant, so they can share it). Its data dir holds the demo model's files.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import make_settings
from tests.model_files import install_demo_model


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def settings(backend: str, tmp_path: Path, request: pytest.FixtureRequest):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    if backend == "postgres":
        made = make_settings(data_dir, database_url=request.getfixturevalue("pg_url"))
    else:
        shutil.copyfile(request.getfixturevalue("sqlite_template"), data_dir / "tunefleet.db")
        made = make_settings(data_dir)
    # The files of the model the registry lists, as `tunefleet serve` builds them: jobs on
    # it are estimated (and placed) from its real config.
    install_demo_model(made.models_dir)
    return made


def chat_lines(n: int = 12) -> bytes:
    rows = [
        {"messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"{2 * i}"},
        ]}
        for i in range(n)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


BAD_LINES = (
    b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    b"{not json\n"
    b'{"messages": [{"role": "user", "content": "only a question"}]}\n'
)


@pytest.fixture
def upload(client) -> Callable[..., Any]:
    def do(headers: dict[str, str], data: bytes | None = None, *, name: str = "train.jsonl",
           purpose: str = "fine-tune") -> Any:
        return client.post(
            "/v1/files", headers=headers,
            files={"file": (name, chat_lines() if data is None else data, "application/jsonl")},
            data={"purpose": purpose},
        )

    return do


@pytest.fixture
def processed_file(upload) -> Callable[..., str]:
    def do(headers: dict[str, str], data: bytes | None = None) -> str:
        response = upload(headers, data)
        assert response.status_code == 200, response.text
        return response.json()["id"]

    return do


@pytest.fixture
def make_job(client, processed_file) -> Callable[..., dict[str, Any]]:
    def do(headers: dict[str, str], **body: Any) -> dict[str, Any]:
        payload = {"model": "tunefleet-tiny-llama", "training_file": processed_file(headers), **body}
        response = client.post("/v1/fine_tuning/jobs", headers=headers, json=payload)
        assert response.status_code == 200, response.text
        return response.json()

    return do


@pytest.fixture
def sdk(client, tenant_key):
    """The official ``openai`` client of a new tenant, over the in-process app; (client, key)."""
    from openai import OpenAI

    tenant = tenant_key()
    return OpenAI(api_key=tenant.key, base_url="http://testserver/v1", http_client=client,
                  max_retries=0), tenant


def start_running(db_session, job_id: str) -> tuple[Any, str]:
    """Admit a created job as the scheduler would (-> ``running``) and issue its trainer's
    report token; returns (job row, token)."""
    from api.jobs.commands import issue_job_token
    from control.db.models import Job
    from control.jobs.lifecycle import transition

    row = db_session.get_one(Job, job_id)
    token = issue_job_token(db_session, row)
    transition(db_session, row, "running", actor="scheduler")
    db_session.commit()
    return row, token
