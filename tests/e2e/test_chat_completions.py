"""Use what you trained: the moment a job succeeds, the official ``openai`` SDK (no retries)
chats with its fine-tuned model (and a checkpoint of it) through the real service and the
real inference worker process -- which the job's success had load the base model -- and
gets the greedy tokens ``peft.PeftModel`` + ``generate`` produce on the downloaded adapter;
another organization gets 404."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from openai import OpenAI

from tests.conftest import free_port
from tests.e2e.test_local_training import create_job, download_adapter, upload, wait_status
from tunefleet.demo import demo_examples

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Capital of Peru?"}]
MAX_TOKENS = 24


def _reference(model_dir: Path, adapter_dir: Path | None) -> tuple[str, int, int]:
    """(text, prompt tokens, completion tokens) of plain transformers (+ peft) greedy decoding."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS)[0, ids.shape[1]:]
    return tok.decode(out, skip_special_tokens=True), ids.shape[1], len(out)


def _other_tenant(http: httpx.Client) -> str:
    tenant = http.post("/admin/tenants", json={"name": "someone-else"})
    assert tenant.status_code == 200, tenant.text
    key = http.post(f"/admin/tenants/{tenant.json()['id']}/api_keys", json={})
    assert key.status_code == 200, key.text
    return key.json()["key"]


def _download_checkpoint_adapter(http: httpx.Client, job_id: str, checkpoint_id: str, dest: Path) -> None:
    base = f"/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint_id}/artifacts"
    listing = http.get(base).json()["data"]
    for item in listing:
        body = http.get(f"{base}/{item['name']}").content
        assert hashlib.sha256(body).hexdigest() == item["sha256"]
        (dest / item["name"]).write_bytes(body)


def test_chat_with_the_fine_tuned_model_right_after_its_job_succeeds(service, tiny_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    svc = service("embedded", TUNEFLEET_INFERENCE_URL=f"http://127.0.0.1:{free_port()}")
    svc.start("inference")
    with svc.http() as http:
        # Two epochs: a checkpoint after each, so the first is not the final adapter.
        job = create_job(http, upload(http, demo_examples(24, seed=1)), n_epochs=2)
        job = wait_status(http, job["id"], {"succeeded", "failed", "cancelled"})
        assert job["status"] == "succeeded", svc.dump_logs()
        model = job["fine_tuned_model"]

        # The job's success hinted the idle worker to load the base model ...
        deadline = time.monotonic() + 120
        while "loaded tunefleet-tiny-llama" not in svc.logs["inference"].read_text():
            assert time.monotonic() < deadline, svc.dump_logs()
            time.sleep(0.5)
        # ... and a first request is answered, not told to retry (it would be held while the
        # model loads, up to TUNEFLEET_INFERENCE_LOAD_WAIT_S).
        first = http.post("/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 2},
                          timeout=120)
        assert first.status_code == 200, first.text

        adapter_dir = tmp_path / "adapter"
        adapter_dir.mkdir()
        download_adapter(http, job["id"], adapter_dir)
        checkpoints = http.get(f"/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
        earliest = min(checkpoints, key=lambda c: c["step_number"])
        checkpoint_dir = tmp_path / "checkpoint"
        checkpoint_dir.mkdir()
        _download_checkpoint_adapter(http, job["id"], earliest["id"], checkpoint_dir)
        other_key = _other_tenant(http)

    oai = OpenAI(api_key=svc.admin_key, base_url=f"{svc.base_url}/v1", max_retries=0)
    text, prompt_tokens, completion_tokens = _reference(tiny_model_dir, adapter_dir)
    assert text and completion_tokens > 1, "nothing to compare: the reference stops at once"
    done = oai.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS)
    assert done.object == "chat.completion" and done.model == model
    assert done.choices[0].message.content == text
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].finish_reason == ("length" if completion_tokens == MAX_TOKENS else "stop")
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens, completion_tokens)

    chunks = list(oai.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                              max_completion_tokens=MAX_TOKENS, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == done.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == completion_tokens
    assert len({c.id for c in chunks}) == 1

    # A checkpoint is a model too, and so is the base model itself.
    checkpoint_text, _, _ = _reference(tiny_model_dir, checkpoint_dir)
    base_text, _, _ = _reference(tiny_model_dir, None)
    for model_id, expected in ((earliest["fine_tuned_model_checkpoint"], checkpoint_text),
                               ("tunefleet-tiny-llama", base_text)):
        answer = oai.chat.completions.create(model=model_id, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS)
        assert answer.choices[0].message.content == expected, model_id
    assert len({text, base_text}) == 2, "the adapter changes nothing"

    stranger = OpenAI(api_key=other_key, base_url=f"{svc.base_url}/v1", max_retries=0)
    for model_id in (model, earliest["fine_tuned_model_checkpoint"]):
        with pytest.raises(openai.NotFoundError) as caught:
            stranger.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4)
        assert caught.value.code == "model_not_found"

    metrics = httpx.get(f"{svc.base_url}/metrics").text
    assert 'tunefleet_inference_requests_total{endpoint="chat.completions",outcome="ok"} 5.0' in metrics
    assert "tunefleet_inference_time_to_first_token_seconds_count" in metrics
    started = time.perf_counter()  # the loaded model answers fast (no timing assertion: informative)
    oai.completions.create(model=model, prompt="Capital of", max_tokens=4, temperature=0)
    print(f"completion on a loaded model: {time.perf_counter() - started:.3f} s")
