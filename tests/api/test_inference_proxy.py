"""Production inference: a base model with ``inference_url`` is served by that OpenAI-compatible
server (a small fake of vLLM's protocol here: tests/fake_vllm.py; no real vLLM runs on
this machine). The adapter is loaded there once under the model's id, requests and
streams pass through, a restarted server gets the adapter again, other tenants never
reach it."""

from __future__ import annotations

import httpx
import openai
import pytest
import yaml
from openai import OpenAI

from control.jobs.lifecycle import transition
from tests.api.test_chat_completions import MESSAGES, job_with_adapters
from tests.fake_vllm import FakeVLLM

BASE = "tunefleet-tiny-llama"


@pytest.fixture
def vllm() -> FakeVLLM:
    return FakeVLLM(served=(BASE,))


@pytest.fixture
def proxied(settings, inline_queue, vllm, live_server, tmp_path):
    """The API (uvicorn) whose registry sends the demo model to the fake server; its URL."""
    from api.main import create_app

    registry = tmp_path / "models.yaml"
    registry.write_text(yaml.safe_dump({"models": [
        {"id": BASE, "path": str(settings.models_dir / "tiny-llama"), "inference_url": live_server(vllm.app)}]}))
    return live_server(create_app(settings.model_copy(update={"base_models_file": registry}), queue=inline_queue))


def test_the_fake_server_speaks_the_protocol_it_stands_for(vllm, live_server, tmp_path) -> None:
    url = live_server(vllm.app)
    (tmp_path / "adapter_config.json").write_text("{}")
    load = {"lora_name": "mine", "lora_path": str(tmp_path)}
    assert httpx.post(f"{url}/v1/chat/completions", json={"model": "mine", "messages": MESSAGES}).status_code == 404
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 200
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=load)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    missing = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "no")})
    assert missing.status_code == 400
    sdk = OpenAI(api_key="none", base_url=f"{url}/v1", max_retries=0)
    assert sdk.chat.completions.create(model="mine", messages=MESSAGES).choices[0].message.content == "mine says hi"


def test_fine_tuned_models_are_loaded_once_then_proxied_streams_included(proxied, vllm, tenant_key, make_job,
                                                                         client, db_session, settings) -> None:
    owner, stranger = tenant_key(), tenant_key()
    row, output, step = job_with_adapters(client, db_session, settings, make_job(owner.headers)["id"])
    transition(db_session, row, "succeeded", actor="executor")
    db_session.commit()
    model, checkpoint = row.fine_tuned_model, f"{row.fine_tuned_model}:ckpt-step-2"
    oai = OpenAI(api_key=owner.key, base_url=f"{proxied}/v1", max_retries=0)

    answer = oai.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=5)
    assert answer.choices[0].message.content == f"{model} says hi" and answer.usage.completion_tokens == 3
    streamed = list(oai.chat.completions.create(model=model, messages=MESSAGES, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == f"{model} says hi"
    loads = [body for kind, body in vllm.calls if kind == "load"]
    assert loads == [{"lora_name": model, "lora_path": f"{output}/adapter"}]  # once, for both requests
    sent = [body for kind, body in vllm.calls if kind == "chat"]
    assert sent[0] == {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": 5}

    vllm.restart()  # the server forgot its adapters: loaded again, the request sent again
    text = oai.completions.create(model=checkpoint, prompt="2+2=", max_tokens=3)
    assert text.choices[0].text == f"{checkpoint} says hi"
    vllm.restart()
    assert oai.chat.completions.create(model=model, messages=MESSAGES).choices[0].message.content.startswith(model)
    loads = [body["lora_path"] for kind, body in vllm.calls if kind == "load"]
    assert loads == [f"{output}/adapter", f"{step}/adapter", f"{output}/adapter"]
    base = oai.chat.completions.create(model=BASE, messages=MESSAGES)
    assert base.choices[0].message.content == f"{BASE} says hi"

    calls = len(vllm.calls)
    other = OpenAI(api_key=stranger.key, base_url=f"{proxied}/v1", max_retries=0)
    for model_id in (model, checkpoint):
        with pytest.raises(openai.NotFoundError) as caught:
            other.chat.completions.create(model=model_id, messages=MESSAGES)
        assert caught.value.code == "model_not_found"
    assert len(vllm.calls) == calls  # never reached the server


def test_an_unreachable_server_is_a_503(settings, inline_queue, live_server, tmp_path, tenant_key) -> None:
    from api.main import create_app

    registry = tmp_path / "models.yaml"
    registry.write_text(yaml.safe_dump({"models": [{"id": BASE, "path": "/nowhere", "inference_url": "http://127.0.0.1:9"}]}))
    url = live_server(create_app(settings.model_copy(update={"base_models_file": registry}), queue=inline_queue))
    down = httpx.post(f"{url}/v1/chat/completions", headers=tenant_key().headers,
                      json={"model": BASE, "messages": MESSAGES})
    assert down.status_code == 503 and down.json()["error"]["code"] == "inference_unavailable"
