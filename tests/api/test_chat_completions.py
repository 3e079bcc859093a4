"""The completion routes between the caller and the inference worker: OpenAI's shapes (read
by the ``openai`` SDK), which model a caller may use, admission and the worker's errors.

The worker is the real server and client over real HTTP; only its engine is scripted
(no model runs here: tests/inference and tests/e2e compare real generations with peft).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from pydantic import SecretStr

from api.db.models import Job
from api.jobs.lifecycle import transition
from inference.engine import ModelLoading
from inference.protocol import StreamEvent
from inference.server import create_app as worker_app
from tests.api.conftest import start_running

SECRET = "s" * 32
MESSAGES = [{"role": "user", "content": "hi"}]


class ScriptedEngine:
    """Answers every request with "Hel" + "lo" per choice (3 tokens, length), after ``gate``."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.loading = False
        self.gate: threading.Event | None = None
        self.delay_s = 0.0

    def generate(self, request):
        self.requests.append(request)
        if self.loading:
            raise ModelLoading(request.base.id)
        yield StreamEvent(type="start", prompt_tokens=5, queued_s=0.0)
        if self.gate is not None:
            self.gate.wait(20)
        time.sleep(self.delay_s)
        for index in range(request.sampling.n):
            yield StreamEvent(type="text", index=index, text="Hel")
            yield StreamEvent(type="text", index=index, text="lo")
            yield StreamEvent(type="finish", index=index, finish_reason="length", completion_tokens=3)

    def status(self) -> dict[str, Any]:
        return {}


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def serving(settings, inline_queue, engine, live_server):
    """``serving(**settings)``: the API (uvicorn) in front of a worker with the scripted engine."""
    from api.main import create_app

    worker_url = live_server(worker_app(engine, SECRET))

    def start(**overrides: Any) -> str:
        values = {"inference_url": worker_url, "inference_secret": SecretStr(SECRET), **overrides}
        return live_server(create_app(settings.model_copy(update=values), queue=inline_queue))

    return start


def _sdk(base_url: str, key: str) -> OpenAI:
    return OpenAI(api_key=key, base_url=f"{base_url}/v1", max_retries=0)


def test_openai_shapes_and_what_the_worker_is_asked(serving, engine, tenant_key, settings) -> None:
    tenant = tenant_key()
    oai = _sdk(serving(), tenant.key)
    done = oai.chat.completions.create(model="tunefleet-tiny-llama", messages=MESSAGES, temperature=0,
                                       max_completion_tokens=7, stop=["\n\n"], seed=3, n=2, top_p=0.5)
    assert done.object == "chat.completion" and done.id.startswith("chatcmpl-")
    assert [(c.index, c.message.content, c.finish_reason) for c in done.choices] == [(0, "Hello", "length"),
                                                                                    (1, "Hello", "length")]
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (5, 6, 11)
    asked = engine.requests[-1]
    assert asked.base.path == str(settings.models_dir / "tiny-llama") and asked.adapter is None
    assert asked.messages == tuple(MESSAGES)
    assert (asked.sampling.max_tokens, asked.sampling.temperature, asked.sampling.top_p, asked.sampling.seed,
            asked.sampling.stop, asked.sampling.n) == (7, 0.0, 0.5, 3, ("\n\n",), 2)

    chunks = list(oai.chat.completions.create(model="tunefleet-tiny-llama", messages=MESSAGES, stream=True,
                                              stream_options={"include_usage": True}))
    assert [(c.choices[0].delta.role, c.choices[0].delta.content, c.choices[0].finish_reason)
            for c in chunks[:-1]] == [("assistant", "", None), (None, "Hel", None), (None, "lo", None),
                                      (None, None, "length")]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 8
    assert engine.requests[-1].sampling.max_tokens == 512  # the default when none is given

    text = oai.completions.create(model="tunefleet-tiny-llama", prompt="2+2=", max_tokens=3)
    assert text.object == "text_completion" and text.choices[0].text == "Hello"
    assert engine.requests[-1].prompt == "2+2=" and engine.requests[-1].messages is None
    streamed = list(oai.completions.create(model="tunefleet-tiny-llama", prompt="2+2=", stream=True))
    assert "".join(c.choices[0].text for c in streamed) == "Hello" and streamed[-1].choices[0].finish_reason

    parts = [{"role": "user", "content": [{"type": "text", "text": "Capital "}, {"type": "text", "text": "of Peru?"}]}]
    oai.chat.completions.create(model="tunefleet-tiny-llama", messages=parts)
    assert engine.requests[-1].messages == ({"role": "user", "content": "Capital of Peru?"},)
    with pytest.raises(openai.BadRequestError) as image:
        oai.chat.completions.create(model="tunefleet-tiny-llama", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert image.value.code == "unsupported_content" and image.value.param == "messages.0.content"

    raw = httpx.post(f"{oai.base_url}chat/completions", headers={"Authorization": f"Bearer {tenant.key}"},
                     json={"model": "tunefleet-tiny-llama", "messages": MESSAGES, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.endswith("data: [DONE]\n\n")


def job_with_adapters(client, db_session, settings, job_id: str) -> tuple[Job, Path, Path]:
    """Run ``job_id`` as far as a trainer that registered a checkpoint at step 2 and its
    final adapter (the job stays ``running``); returns (job row, output dir, checkpoint dir)."""
    row, token = start_running(db_session, job_id)
    output = settings.data_path / "artifacts" / job_id / "output"
    step = settings.job_dir(job_id) / "checkpoints" / "step-2"
    for directory in (output / "adapter", step / "adapter"):
        directory.mkdir(parents=True)
        (directory / "adapter_model.safetensors").write_bytes(b"w")
        (directory / "adapter_config.json").write_text("{}")
    report = client.post(f"/internal/v1/jobs/{job_id}/reports", headers={"Authorization": f"Bearer {token}"},
                         json={"seq": 0, "items": [
                             {"type": "checkpoint", "step": 2, "location": str(step), "metrics": {}},
                             {"type": "artifacts", "location": str(output), "files": [
                                 {"name": "adapter/adapter_model.safetensors", "bytes": 1, "sha256": "0" * 64}]}]})
    assert report.status_code == 200, report.text
    db_session.refresh(row)
    return row, output, step


def test_fine_tuned_models_and_checkpoints_are_their_tenants_only(serving, engine, tenant_key, make_job,
                                                                  db_session, client, settings) -> None:
    owner, stranger = tenant_key(), tenant_key()
    row, output, step = job_with_adapters(client, db_session, settings, make_job(owner.headers)["id"])
    checkpoint_model = f"{row.fine_tuned_model}:ckpt-step-2"
    base_url = serving()
    oai, other = _sdk(base_url, owner.key), _sdk(base_url, stranger.key)

    with pytest.raises(openai.NotFoundError) as running:  # a checkpoint serves while the job runs
        oai.chat.completions.create(model=row.fine_tuned_model, messages=MESSAGES)
    assert running.value.code == "model_not_found"
    oai.chat.completions.create(model=checkpoint_model, messages=MESSAGES)
    assert engine.requests[-1].adapter.path == f"{step}/adapter"

    transition(db_session, row, "succeeded", actor="executor")
    db_session.commit()
    answer = oai.chat.completions.create(model=row.fine_tuned_model, messages=MESSAGES)
    assert answer.model == row.fine_tuned_model and engine.requests[-1].adapter.path == f"{output}/adapter"
    asked = len(engine.requests)
    for model in (row.fine_tuned_model, checkpoint_model, f"{row.fine_tuned_model}:ckpt-step-9", "ft:nope:x:y"):
        with pytest.raises(openai.NotFoundError) as caught:
            (oai if model.endswith(("step-9", ":y")) else other).chat.completions.create(model=model, messages=MESSAGES)
        assert caught.value.code == "model_not_found" and caught.value.param == "model", model
    assert len(engine.requests) == asked  # the worker never heard of them


def test_a_tenant_over_its_concurrent_limit_gets_429_with_retry_after(serving, engine, tenant_key) -> None:
    engine.gate = threading.Event()
    base_url = serving(inference_max_concurrent_per_tenant=1)
    first, second = tenant_key(), tenant_key()
    body = {"model": "tunefleet-tiny-llama", "messages": MESSAGES, "stream": True}
    url = f"{base_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=first.headers, timeout=30) as held:
        assert held.status_code == 200  # holding its slot until the gate opens
        busy = httpx.post(url, json=body, headers=first.headers)
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
        assert busy.json()["error"]["code"] == "too_many_requests"
        others: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: others.append(httpx.post(url, json=body, headers=second.headers,
                                                                          timeout=30)))
        thread.start()  # another organization is not limited by this one
        time.sleep(0.5)
        engine.gate.set()
        held.read()
        thread.join()
    assert others[0].status_code == 200
    assert httpx.post(url, json=body, headers=first.headers, timeout=30).status_code == 200  # slot given back


def test_worker_refusals_and_failures_are_clear_errors(serving, engine, tenant_key, live_server) -> None:
    tenant = tenant_key()
    body = {"model": "tunefleet-tiny-llama", "messages": MESSAGES}

    def post(base_url: str, **extra: Any) -> httpx.Response:
        return httpx.post(f"{base_url}/v1/chat/completions", json={**body, **extra}, headers=tenant.headers,
                          timeout=30)

    base_url = serving()
    engine.loading = True
    loading = post(base_url)
    assert loading.status_code == 503 and loading.headers["Retry-After"] == "2"
    assert loading.json()["error"]["code"] == "model_loading"
    engine.loading = False
    for extra, code in (({"logprobs": True}, "unsupported_parameter"), ({"frequency_penalty": 0.5}, "unsupported_parameter"),
                        ({"temperature": 3}, "invalid_request"), ({"stop": ["a"] * 5}, "invalid_request"),
                        ({"bogus": 1}, "invalid_request"), ({"messages": [{"content": "no role"}]}, "invalid_request")):
        refused = post(base_url, **extra)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == code, (extra, refused.text)

    engine.delay_s = 2.0
    slow = post(serving(inference_timeout_s=0.5))
    assert slow.status_code == 504 and slow.json()["error"]["code"] == "inference_timeout"
    engine.delay_s = 0.0
    wrong_secret = post(serving(inference_secret=SecretStr("w" * 32)))
    assert wrong_secret.status_code == 503 and wrong_secret.json()["error"]["code"] == "inference_unavailable"
    down = post(serving(inference_url="http://127.0.0.1:9"))
    assert down.status_code == 503 and down.json()["error"]["code"] == "inference_unavailable"
    assert httpx.post(f"{base_url}/v1/chat/completions", json=body).status_code == 401


def test_a_tenant_over_its_tokens_per_minute_gets_429_until_they_age_out(serving, tenant_key) -> None:
    base_url = serving(inference_tokens_per_minute_per_tenant=10)
    first, second = tenant_key(), tenant_key()
    url, body = f"{base_url}/v1/chat/completions", {"model": "tunefleet-tiny-llama", "messages": MESSAGES}
    # Each answer uses 5 prompt + 3 completion tokens; a request is admitted while under the limit.
    assert [httpx.post(url, json=body, headers=first.headers).status_code for _ in range(2)] == [200, 200]
    over = httpx.post(url, json=body, headers=first.headers)
    assert over.status_code == 429 and over.json()["error"]["code"] == "token_limit_exceeded"
    assert 1 <= int(over.headers["Retry-After"]) <= 60
    assert httpx.post(url, json=body, headers=second.headers).status_code == 200


def test_token_budget_ages_out_by_the_minute() -> None:
    from api.inference.completions import TokenBudget

    now = [1000.0]
    budget = TokenBudget(10, clock=lambda: now[0])
    budget.spend("t", 6)
    now[0] += 20
    budget.spend("t", 6)
    assert budget.retry_after("t") == 40  # the first 6 age out 60 s after they were spent
    assert budget.retry_after("other") is None
    now[0] += 40
    assert budget.retry_after("t") is None
