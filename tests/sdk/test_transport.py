"""Retry, backoff and idempotency behaviour of the SDK transport.

The service never answers 429/503 on purpose, so these tests put a scripted
``httpx.MockTransport`` under the real client and check what goes over the wire.
Sleeps are recorded instead of slept.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.sdk.conftest import run_in_fresh_loop
from tunefleet import APIConnectionError, AsyncTunefleet, RateLimitError, ServerError, Tunefleet
from tunefleet.sdk import transport
from tunefleet.sdk.sse import SSEDecoder

JOB = {"id": "ftjob-1", "object": "fine_tuning.job", "status": "queued", "model": "m", "created_at": 1}


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    recorded: list[float] = []
    monkeypatch.setattr(transport.time, "sleep", recorded.append)

    async def fake_async_sleep(seconds: float) -> None:
        recorded.append(seconds)

    monkeypatch.setattr(transport.asyncio, "sleep", fake_async_sleep)
    return recorded


def scripted(answers: list[Callable[[httpx.Request], httpx.Response]]) -> tuple[httpx.Client, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers[min(len(seen) - 1, len(answers) - 1)](request)

    return httpx.Client(transport=httpx.MockTransport(handler)), seen


def error(status: int, headers: dict[str, str] | None = None) -> Callable[[httpx.Request], httpx.Response]:
    body = {"error": {"message": f"status {status}", "type": "x", "param": None, "code": f"code_{status}"}}
    return lambda request: httpx.Response(status, json=body, headers=headers)


def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=JOB)


def test_429_retry_after_is_honoured_and_idempotency_key_reused(sleeps: list[float]) -> None:
    http, seen = scripted([error(429, {"Retry-After": "3"}), error(503), ok])
    client = Tunefleet(base_url="http://svc", api_key="k", http_client=http)
    job = client.jobs.create(model="m", training_file="file-1")
    assert job.id == "ftjob-1"
    assert len(seen) == 3
    keys = {r.headers["Idempotency-Key"] for r in seen}
    assert len(keys) == 1 and next(iter(keys)).startswith("tf-")
    assert all(json.loads(r.content) == {"model": "m", "training_file": "file-1"} for r in seen)
    assert sleeps[0] == 3.0
    assert 0.5 * 1.5 <= sleeps[1] <= 1.0 * 1.25  # attempt 1: 1 s base with +-25 % jitter
    assert seen[0].headers["Authorization"] == "Bearer k"


def test_gives_up_after_max_retries_with_typed_error(sleeps: list[float]) -> None:
    http, seen = scripted([error(429)])
    client = Tunefleet(base_url="http://svc", api_key="k", http_client=http, max_retries=2)
    with pytest.raises(RateLimitError) as exc:
        client.jobs.list()
    assert len(seen) == 3 and len(sleeps) == 2
    assert exc.value.status == 429 and exc.value.code == "code_429"


def test_500_and_502_on_a_plain_post_are_not_retried(sleeps: list[float]) -> None:
    for status in (500, 502):
        http, seen = scripted([error(status), ok])
        client = Tunefleet(base_url="http://svc", api_key="k", http_client=http)
        with pytest.raises(ServerError):
            client.jobs.cancel("ftjob-1")  # not idempotent: the service may have acted
        assert len(seen) == 1
    http, seen = scripted([error(502), ok])
    client = Tunefleet(base_url="http://svc", api_key="k", http_client=http)
    assert client.jobs.retrieve("ftjob-1").id == "ftjob-1"  # a GET may be replayed
    assert len(seen) == 2


def test_connect_errors_are_retried_then_raised(sleeps: list[float]) -> None:
    attempts: list[int] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        attempts.append(1)
        if len(attempts) < 3:
            raise httpx.ConnectError("refused", request=request)
        return ok(request)

    client = Tunefleet(base_url="http://svc", api_key="k",
                       http_client=httpx.Client(transport=httpx.MockTransport(refuse)))
    assert client.jobs.cancel("ftjob-1").id == "ftjob-1"
    assert len(attempts) == 3

    def always_refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    client = Tunefleet(base_url="http://svc", api_key="k", max_retries=1,
                       http_client=httpx.Client(transport=httpx.MockTransport(always_refuse)))
    with pytest.raises(APIConnectionError):
        client.jobs.list()


def test_async_transport_retries_the_same_way(sleeps: list[float]) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return error(503)(request) if len(seen) == 1 else ok(request)

    async def scenario() -> None:
        async with (
            httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http,
            AsyncTunefleet(base_url="http://svc", api_key="k", http_client=http) as client,
        ):
            job = await client.jobs.create(model="m", training_file="f", idempotency_key="mine")
            assert job.id == "ftjob-1"

    run_in_fresh_loop(scenario())
    assert [r.headers["Idempotency-Key"] for r in seen] == ["mine", "mine"]


def test_retry_after_http_date_and_cap() -> None:
    far = httpx.Response(429, headers={"Retry-After": "Wed, 21 Oct 2099 07:28:00 GMT"})
    assert transport.retry_after_seconds(far) == 60.0
    past = httpx.Response(429, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert transport.retry_after_seconds(past) == 0.0
    assert transport.retry_after_seconds(httpx.Response(429, headers={"Retry-After": "junk"})) is None


def test_sse_decoder_follows_the_whatwg_rules() -> None:
    decoder = SSEDecoder()
    lines = ["retry: 2000", "", ": keep-alive", "id: 4.1", "event: metric", 'data: {"a":', "data: 1}", "",
             "data: no-event-name", ""]
    out = [m for m in (decoder.feed(line) for line in lines) if m is not None]
    assert [(m.event, m.data, m.id) for m in out] == [
        ("metric", '{"a":\n1}', "4.1"), ("message", "no-event-name", "4.1")]
    assert decoder.retry_ms == 2000 and decoder.last_event_id == "4.1"


def test_artifact_download_follows_the_s3_redirect_without_the_api_key(tmp_path: Path) -> None:
    import hashlib

    content = b"adapter weights" * 100
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "svc":
            return httpx.Response(307, headers={"Location": "http://s3.example/bucket/out/adapter.bin?X-Sig=1"})
        return httpx.Response(200, content=content)

    client = Tunefleet(base_url="http://svc", api_key="secret-key",
                       http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    path = client.jobs.download_artifact("ftjob-1", "adapter/adapter.bin", tmp_path / "a.bin",
                                         expected_sha256=hashlib.sha256(content).hexdigest())
    assert path.read_bytes() == content
    assert [r.url.host for r in seen] == ["svc", "s3.example"]
    assert seen[0].headers["Authorization"] == "Bearer secret-key"
    assert "Authorization" not in seen[1].headers
