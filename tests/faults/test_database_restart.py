"""A PostgreSQL restart between two requests: the next request still answers (no 500).

A restart closes every server connection; the API's pool still holds them. The test
does to the pool what a restart does, terminating each backend of the test database
(``pg_terminate_backend``), and asks again: the pool must notice (pre-ping) and connect
anew instead of handing the request a dead connection.

While the database cannot be reached at all, every route -- a user's and a trainer's
report alike -- answers 503 ``database_unavailable`` with ``Retry-After``, not a 500 that
reads as a bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import PG_ADMIN_DSN, free_port, make_settings

pytestmark = pytest.mark.postgres


def _terminate_connections(database: str) -> int:
    import psycopg

    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()", (database,),
        ).fetchall()
    return len(rows)


def test_the_first_request_after_a_database_restart_succeeds(pg_url: str, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.main import create_app
    from control.auth import create_api_key, create_tenant
    from control.db.session import session_scope
    from control.queue import RecordingQueue

    settings = make_settings(tmp_path, database_url=pg_url)
    with session_scope(pg_url) as session:
        tenant = create_tenant(session, f"restart-{tmp_path.name}")
        _, key = create_api_key(session, tenant)
    headers = {"Authorization": f"Bearer {key}"}
    app = create_app(settings, queue=RecordingQueue())
    with TestClient(app, raise_server_exceptions=False) as client:
        for _ in range(3):  # fill the pool with live connections
            assert client.get("/v1/fine_tuning/jobs", headers=headers).status_code == 200
        assert _terminate_connections(pg_url.rsplit("/", 1)[1]) >= 1
        for path in ("/v1/files", "/v1/fine_tuning/jobs", "/v1/files"):
            answer = client.get(path, headers=headers)
            assert answer.status_code == 200, answer.text


def test_requests_while_the_database_is_down_answer_503_with_retry_after(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.main import create_app
    from control.queue import RecordingQueue

    down = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/tunefleet"  # nothing listens there
    app = create_app(make_settings(tmp_path, database_url=down), queue=RecordingQueue())
    client = TestClient(app, raise_server_exceptions=False)
    report = {"seq": 1, "items": [{"type": "metric", "step": 1, "train_loss": 1.0}]}
    for method, path, body, token in (("GET", "/v1/fine_tuning/jobs", None, "tf_abcdefgh_" + "0" * 32),
                                      ("POST", "/internal/v1/jobs/ftjob-x/reports", report, "job-token")):
        answer = client.request(method, path, json=body, headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 503, answer.text
        assert answer.headers["Retry-After"] == "5"
        assert answer.json()["error"]["code"] == "database_unavailable"
