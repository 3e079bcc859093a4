"""Open job streams never take the database pool from other tenants.

The probe: sixteen ``GET .../stream`` connections on a paused job held one pooled
connection each for as long as they stayed open ("QueuePool limit of size 5 overflow 10
reached"), and another tenant's ``GET /v1/files`` then waited 27 s for a connection.
Each test runs through uvicorn on SQLite and on PostgreSQL with the pool the service
builds for it (``control.db.session.get_engine``): more streams than that pool has
connections, and another tenant's request must still be answered at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from tests.api.conftest import start_running
from tests.conftest import make_settings

# Another tenant's request while the streams are open: a pooled connection is free at once,
# so this bounds a loaded machine's scheduling, not a wait for the pool (30 s timeout).
OTHER_TENANT_BOUND_S = 5.0


def pool_connections(engine: Any) -> int:
    """How many connections ``engine``'s pool hands out at most (size + overflow)."""
    return engine.pool.size() + engine.pool._max_overflow


@pytest.fixture
def stream_app(settings, inline_queue):
    """The app with stream caps above what the pool could hold, so the caps are not what
    protects the pool here."""
    from api.main import create_app

    tuned = make_settings(settings.data_path, database_url=settings.resolved_database_url,
                          stream_max_per_key=1000, stream_max_per_process=1000)
    return create_app(tuned, queue=inline_queue)


@contextmanager
def open_streams(base: str, path: str, headers: dict[str, str], count: int) -> Iterator[list[int]]:
    """``count`` streams of ``path``, each read past its first line; yields their statuses."""
    statuses: list[int] = []
    readers: list[Iterator[str]] = []  # kept: a dropped line iterator closes its response
    with ExitStack() as stack:
        client = stack.enter_context(httpx.Client(base_url=base, timeout=httpx.Timeout(20, read=None)))
        for _ in range(count):
            answer = stack.enter_context(client.stream("GET", path, headers=headers))
            statuses.append(answer.status_code)
            if answer.status_code == 200:
                readers.append(answer.iter_lines())
                assert next(readers[-1]).startswith("retry:")
        yield statuses


def paused_job(client, make_job, db_session, headers: dict[str, str]) -> dict[str, Any]:
    job = make_job(headers)
    start_running(db_session, job["id"])
    answer = client.post(f"/v1/fine_tuning/jobs/{job['id']}/pause", headers=headers)
    assert answer.status_code == 200 and answer.json()["status"] == "paused", answer.text
    return job


def test_streams_on_a_paused_job_leave_the_pool_to_other_tenants(
    stream_app, client, live_server, make_job, tenant_key, db_session, processed_file
) -> None:
    owner, other = tenant_key(), tenant_key()
    processed_file(other.headers)
    job = paused_job(client, make_job, db_session, owner.headers)
    engine = stream_app.state.engine
    count = pool_connections(engine) + 1
    base = live_server(stream_app)

    with open_streams(base, f"/v1/fine_tuning/jobs/{job['id']}/stream", owner.headers, count) as statuses:
        assert statuses == [200] * count
        held = engine.pool.checkedout()
        started = time.monotonic()
        answer = httpx.get(f"{base}/v1/files", headers=other.headers, timeout=OTHER_TENANT_BOUND_S * 4)
        waited = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    assert waited < OTHER_TENANT_BOUND_S, f"another tenant waited {waited:.1f} s behind {count} streams"
    # A paused job's streams idle between polls: they hold no connection then.
    assert held < count, f"{held} connections held by {count} idle streams"


def test_streams_past_the_per_key_cap_are_refused(
    settings, inline_queue, client, live_server, make_job, tenant_key, db_session
) -> None:
    from api.main import create_app

    app = create_app(make_settings(settings.data_path, database_url=settings.resolved_database_url,
                                   stream_max_per_key=2), queue=inline_queue)
    owner, second = tenant_key(), tenant_key()
    job = paused_job(client, make_job, db_session, owner.headers)
    path = f"/v1/fine_tuning/jobs/{job['id']}/stream"
    base = live_server(app)
    with open_streams(base, path, owner.headers, 3) as statuses:
        assert statuses == [200, 200, 429]
        refused = httpx.get(f"{base}{path}", headers=owner.headers, timeout=10)
        # Another key's streams count on their own.
        other_job = paused_job(client, make_job, db_session, second.headers)
        with open_streams(base, f"/v1/fine_tuning/jobs/{other_job['id']}/stream", second.headers, 1) as mine:
            assert mine == [200]
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("too_many_streams", "rate_limit_error")
    assert "2" in error["message"] and refused.headers["retry-after"].isdigit()
    # Closed streams give their slots back.
    with open_streams(base, path, owner.headers, 2) as statuses:
        assert statuses == [200, 200]


def test_streams_past_the_per_process_cap_are_refused(
    settings, inline_queue, client, live_server, make_job, tenant_key, db_session
) -> None:
    from api.main import create_app

    app = create_app(make_settings(settings.data_path, database_url=settings.resolved_database_url,
                                   stream_max_per_process=2), queue=inline_queue)
    first, second = tenant_key(), tenant_key()
    jobs = [paused_job(client, make_job, db_session, k.headers) for k in (first, second)]
    base = live_server(app)
    with open_streams(base, f"/v1/fine_tuning/jobs/{jobs[0]['id']}/stream", first.headers, 2) as statuses:
        assert statuses == [200, 200]
        refused = httpx.get(f"{base}/v1/fine_tuning/jobs/{jobs[1]['id']}/stream", headers=second.headers,
                            timeout=10)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_streams"


def test_a_paused_job_is_polled_at_the_idle_interval(
    stream_app, client, live_server, make_job, tenant_key, db_session, monkeypatch
) -> None:
    from api.outputs import stream

    polls: list[float] = []
    real_poll = stream.poll_job

    def counting_poll(*args: Any, **kwargs: Any) -> Any:
        polls.append(time.monotonic())
        return real_poll(*args, **kwargs)

    monkeypatch.setattr(stream, "poll_job", counting_poll)
    monkeypatch.setattr(stream, "POLL_S", 0.05)
    monkeypatch.setattr(stream, "IDLE_POLL_S", 0.5)
    owner = tenant_key()
    job = paused_job(client, make_job, db_session, owner.headers)
    base = live_server(stream_app)
    with open_streams(base, f"/v1/fine_tuning/jobs/{job['id']}/stream", owner.headers, 1):
        time.sleep(1.2)  # the window the polls are counted over
    # 1.2 s at 0.5 s while paused: 2-4 polls (at the running interval it would be ~24).
    assert 1 <= len(polls) <= 5, polls
