"""Hostile and careless tenants against the real API and inference worker (its real engine on
the demo model): abandoned streams and long prompts leave another tenant's short request
answered within a stated bound, and the abandoning tenant's slots come back."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from inference.engine import Engine
from inference.server import create_app as worker_app

SECRET = "u" * 32
ANSWER_BOUND_S = 5.0  # another tenant's 2-token request, whatever the others do
LONG_PROMPT = "x" * 400  # with the chat template about 430 of the demo model's 512 tokens


@pytest.fixture
def backend() -> str:
    return "sqlite"  # nothing here is about the database


def _chat(base: str, headers: dict[str, str], timeout: float = 120, **body: Any) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=timeout,
                      json={"model": "tunefleet-tiny-llama", "messages": [{"role": "user", "content": "hi"}], **body})


def _abandon(base: str, headers: dict[str, str], streaming: threading.Barrier) -> None:
    """16 choices of up to 480 tokens, streamed; gone after the first chunk."""
    with httpx.stream("POST", f"{base}/v1/chat/completions", headers=headers, timeout=60, json={
            "model": "tunefleet-tiny-llama", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "n": 16, "max_tokens": 480, "temperature": 1}) as response:
        assert response.status_code == 200
        assert next(line for line in response.iter_lines() if line.startswith("data: "))
        streaming.wait(60)


def test_abandoned_streams_and_long_prompts_leave_another_tenant_answered(settings, inline_queue, live_server,
                                                                          tenant_key) -> None:
    from api.main import create_app

    engine = Engine(device="cpu")
    worker = live_server(worker_app(engine, SECRET))
    base = live_server(create_app(settings.model_copy(update={
        "inference_url": worker, "inference_secret": SecretStr(SECRET)}), queue=inline_queue))
    hog, verbose, short = tenant_key(), tenant_key(), tenant_key()
    assert _chat(base, short.headers, max_tokens=2).status_code == 200  # waits while the model loads

    streaming = threading.Barrier(5)
    abandoned = [threading.Thread(target=_abandon, args=(base, hog.headers, streaming)) for _ in range(4)]
    answers: list[httpx.Response] = []
    long_ones = [threading.Thread(target=lambda: answers.append(_chat(
        base, verbose.headers, messages=[{"role": "user", "content": LONG_PROMPT}], n=4, max_tokens=24,
        temperature=1))) for _ in range(2)]
    for thread in (*abandoned, *long_ones):
        thread.start()
    streaming.wait(60)  # the four streams run (and the long prompts wait their turns); now they leave
    for thread in abandoned:
        thread.join(30)

    asked = time.monotonic()
    answered = _chat(base, short.headers, max_tokens=2)
    took = time.monotonic() - asked
    assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 2
    assert took < ANSWER_BOUND_S, took
    assert any(t.is_alive() for t in long_ones), "the long requests ended first: nothing was measured"

    # The abandoning tenant has all of its slots (4) again.
    again: list[int] = []
    retry = [threading.Thread(target=lambda: again.append(_chat(base, hog.headers, max_tokens=2).status_code))
             for _ in range(4)]
    for thread in retry:
        thread.start()
    for thread in (*retry, *long_ones):
        thread.join(120)
    assert again == [200] * 4
    assert [(a.status_code, len(a.json()["choices"])) for a in answers] == [(200, 4), (200, 4)]
    assert engine.status()["generations"] == 0
