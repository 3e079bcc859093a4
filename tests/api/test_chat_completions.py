"""The completion routes between the caller and the inference worker: OpenAI's shapes (read
by the ``openai`` SDK), which model a caller may use, admission and the worker's errors.

The worker is the real server and client over real HTTP; only its engine is scripted
(no model runs here: tests/inference and tests/e2e compare real generations with peft).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from openai import OpenAI
from pydantic import SecretStr

from control.db.models import Job
from control.jobs.lifecycle import transition
from inference.engine import InferenceError, ModelLoading
from inference.protocol import ModelRef, StreamEvent
from inference.server import create_app as worker_app
from tests.api.conftest import start_running
from tests.inference.scripted import ScriptedEngine

SECRET = "s" * 32
MESSAGES = [{"role": "user", "content": "hi"}]


class HelloEngine(ScriptedEngine):
    """Answers every request with "Hel" + "lo" per choice (3 tokens, length).

    ``loading`` / ``refusal``: refuse instead; ``held``: wait before the ``start`` event (a
    model loading, a turn awaited) and ``gated``: after it, until :meth:`release`;
    ``fail_code``: an error event after ``start`` instead of the text."""

    def __init__(self) -> None:
        super().__init__()
        self.loading = False
        self.refusal: InferenceError | None = None
        self.held = self.gated = False
        self.delay_s = 0.0
        self.fail_code: str | None = None

    def release(self) -> None:
        self.held = self.gated = False
        self.changed()

    def generate(self, request):
        if self.loading:
            raise ModelLoading(request.base.id)
        if self.refusal is not None:
            raise self.refusal
        if not self.wait_until(lambda: not self.held):
            return
        yield StreamEvent(type="start", prompt_tokens=5, queued_s=0.0)
        if not self.wait_until(lambda: not self.gated):
            return
        time.sleep(self.delay_s)
        if self.fail_code is not None:
            yield StreamEvent(type="error", code=self.fail_code, message="scripted")
            return
        for index in range(request.sampling.n):
            yield StreamEvent(type="text", index=index, text="Hel")
            yield StreamEvent(type="text", index=index, text="lo")
            yield StreamEvent(type="finish", index=index, finish_reason="length", completion_tokens=3)


@pytest.fixture
def engine() -> HelloEngine:
    return HelloEngine()


@pytest.fixture
def serving(settings, inline_queue, engine, live_server):
    """``serving(**settings)``: the API (uvicorn) in front of a worker with the scripted engine."""
    from api.main import create_app

    worker_url = live_server(worker_app(engine, SECRET))

    def start(**overrides: Any) -> str:
        values = {"inference_url": worker_url, "inference_secret": SecretStr(SECRET), **overrides}
        start.app = create_app(settings.model_copy(update=values), queue=inline_queue)
        return live_server(start.app)

    return start


@contextlib.contextmanager
def _raw_post(url: str, body: dict[str, Any], headers: dict[str, str]) -> Iterator[None]:
    """POST ``body`` on a socket of our own and hang up when the block ends: a client that
    gives up while its request waits."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Host": parts.netloc, "Content-Type": "application/json",
                                                  "Content-Length": str(len(payload))}.items())
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(f"POST {parts.path} HTTP/1.1\r\n{head}\r\n".encode() + payload)
        yield


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
    # The caller's max_tokens is binding; turns are taken as this tenant; a loading model is waited for.
    assert (asked.sampling.fit_context, asked.tenant, asked.load_wait_s) == (False, tenant.tenant_id, 120.0)

    chunks = list(oai.chat.completions.create(model="tunefleet-tiny-llama", messages=MESSAGES, stream=True,
                                              stream_options={"include_usage": True}))
    assert [(c.choices[0].delta.role, c.choices[0].delta.content, c.choices[0].finish_reason)
            for c in chunks[:-1]] == [("assistant", "", None), (None, "Hel", None), (None, "lo", None),
                                      (None, None, "length")]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 8
    # The default when none is given, shortened by the worker to what the context leaves.
    assert (engine.requests[-1].sampling.max_tokens, engine.requests[-1].sampling.fit_context) == (512, True)

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


def test_a_job_that_succeeds_hints_the_worker_to_load_its_base_model(serving, engine, tenant_key, make_job,
                                                                    db_session, client, settings) -> None:
    owner = tenant_key()
    row, _, _ = job_with_adapters(client, db_session, settings, make_job(owner.headers)["id"])
    serving()  # the last app built installs the hook: this one, whose worker is the scripted one
    assert engine.preloaded == []  # running jobs and checkpoints hint nothing
    transition(db_session, row, "succeeded", actor="executor")
    db_session.commit()
    assert engine.wait_preloaded(1), "no preload hint"
    assert engine.preloaded == [ModelRef(id="tunefleet-tiny-llama", path=str(settings.models_dir / "tiny-llama"))]


def test_a_tenant_over_its_concurrent_limit_gets_429_with_retry_after(serving, engine, tenant_key) -> None:
    engine.gated = True
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
        engine.release()
        held.read()
        thread.join()
    assert others[0].status_code == 200
    assert httpx.post(url, json=body, headers=first.headers, timeout=30).status_code == 200  # slot given back


def test_a_client_that_leaves_gets_its_slot_back_and_its_generation_cancelled(serving, engine, tenant_key) -> None:
    base_url = serving(inference_max_concurrent_per_tenant=1)
    tenant = tenant_key()
    url = f"{base_url}/v1/chat/completions"
    body = {"model": "tunefleet-tiny-llama", "messages": MESSAGES, "stream": True}
    # While its request waits for the model (loading, or another tenant's turn) ...
    engine.held = True
    with _raw_post(url, body, tenant.headers):
        assert engine.wait_requests(1)
    assert engine.wait_cancelled(1), "the worker's generation was not cancelled"
    # ... and while it streams.
    engine.held, engine.gated = False, True
    with httpx.stream("POST", url, json=body, headers=tenant.headers, timeout=30) as response:
        assert response.status_code == 200  # the stream started; the client leaves
    assert engine.wait_cancelled(2)
    engine.release()
    # The slot came back each time (the API gives it back before it closes the worker's stream).
    assert httpx.post(url, json=body, headers=tenant.headers, timeout=30).status_code == 200


def test_a_running_completion_holds_no_database_connection(serving, engine, tenant_key) -> None:
    base_url = serving()
    engine.gated = True
    pool = serving.app.state.engine.pool
    tenant = tenant_key()
    body = {"model": "tunefleet-tiny-llama", "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=tenant.headers,
                      timeout=30) as response:
        assert response.status_code == 200
        assert pool.checkedout() == 0  # many long completions cannot use up the pool
        engine.release()
        response.read()


def test_a_prompt_over_the_models_context_is_openais_400(serving, engine, tenant_key) -> None:
    oai = _sdk(serving(), tenant_key().key)
    engine.refusal = InferenceError(400, "context_length_exceeded", "This model's maximum context length is 512 "
                                    "tokens. However, you requested 600 tokens (100 in the messages, 500 in the "
                                    "completion). Please reduce the length of the messages or completion.",
                                    param="messages")
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model="tunefleet-tiny-llama", messages=MESSAGES, max_tokens=500)
    error = refused.value.body
    assert (refused.value.code, refused.value.param, error["type"]) == ("context_length_exceeded", "messages",
                                                                        "invalid_request_error")
    assert error["message"].startswith("This model's maximum context length is 512 tokens.")


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
    for extra, code in (({"logprobs": True}, "unsupported_parameter"),
                        ({"frequency_penalty": 0.5}, "unsupported_parameter"),
                        ({"temperature": 3}, "invalid_request"), ({"stop": ["a"] * 5}, "invalid_request"),
                        ({"bogus": 1}, "invalid_request"), ({"messages": [{"content": "no role"}]}, "invalid_request"),
                        ({"n": 17}, "invalid_request")):
        refused = post(base_url, **extra)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == code, (extra, refused.text)

    # The worker stopping under a generation (serve restarts it): worth a retry, mid-stream too.
    engine.fail_code = "worker_stopping"
    stopped = post(base_url)
    assert stopped.status_code == 503 and stopped.json()["error"]["code"] == "inference_unavailable"
    streamed = post(base_url, stream=True).text.split("\n\n")
    assert '"code":"inference_unavailable"' in streamed[-3] and streamed[-2] == "data: [DONE]", streamed
    engine.fail_code = None

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
