"""The SSE stream stops working for a client that went away.

A running job's stream polls the database every ``POLL_S``; once the client disconnects
the server must stop polling and writing, or every abandoned dashboard tab would keep a
database poll going until its job ends (hours). Once through uvicorn, and once at the
ASGI level with a disconnect that takes a moment to arrive (as behind a proxy or on
another ASGI server): the stream peeked for it and never saw it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.api.conftest import start_running


@pytest.fixture
def backend() -> str:
    return "sqlite"


@pytest.fixture
def counted_polls(monkeypatch) -> list[float]:
    from api.outputs import stream

    polls: list[float] = []
    real_poll = stream.poll_job

    def counting_poll(*args, **kwargs):
        polls.append(time.monotonic())
        return real_poll(*args, **kwargs)

    monkeypatch.setattr(stream, "poll_job", counting_poll)
    monkeypatch.setattr(stream, "POLL_S", 0.05)
    return polls


def test_the_stream_stops_when_the_client_disconnects(
    app, live_server, make_job, tenant_key, db_session, counted_polls
) -> None:
    polls = counted_polls
    key = tenant_key()
    job = make_job(key.headers)
    start_running(db_session, job["id"])  # a running job: its stream does not end by itself
    base = live_server(app)

    url = f"{base}/v1/fine_tuning/jobs/{job['id']}/stream"
    with httpx.Client(timeout=10) as client, client.stream("GET", url, headers=key.headers) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = answer.iter_lines()  # kept: a dropped line iterator closes the response
        assert next(lines).startswith("retry:")
        deadline = time.monotonic() + 10
        while len(polls) < 3:  # the server is streaming
            assert time.monotonic() < deadline
            time.sleep(0.02)
    # leaving the block closed the connection
    time.sleep(0.5)  # let the server notice
    settled = len(polls)
    time.sleep(1.0)  # 20 poll intervals
    assert len(polls) == settled, f"{len(polls) - settled} polls after the client left"


def test_a_disconnect_that_arrives_late_still_stops_the_stream(
    app, make_job, tenant_key, db_session, counted_polls
) -> None:
    key = tenant_key()
    job = make_job(key.headers)
    start_running(db_session, job["id"])
    path = f"/v1/fine_tuning/jobs/{job['id']}/stream"
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("test", 80),
        "headers": [(b"host", b"test"), (b"authorization", key.headers["Authorization"].encode())],
    }
    received = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal received
        received += 1
        if received == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(0.3)  # the client leaves; the server hears of it a moment later
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> bool:
        answer = asyncio.create_task(app(scope, receive, send))
        done, _ = await asyncio.wait({answer}, timeout=3)
        answer.cancel()
        return answer in done

    assert asyncio.run(run()), f"still streaming 3 s after the client left ({len(counted_polls)} polls)"
    assert sent[0]["status"] == 200
    assert len(counted_polls) < 20  # ~0.3 s of polling at 0.05 s, not 3 s
