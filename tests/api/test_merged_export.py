"""Merged exports: ``POST .../exports`` queues the merge, the task (run here inline, as a worker
runs it) writes sharded safetensors that ``AutoModelForCausalLM`` loads with the logits of
base + adapter under peft (1e-4, fp32); progress and result are job events."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch

from api.jobs.lifecycle import transition
from tests.api.conftest import start_running
from worker.tasks import exports

JOBS = "/v1/fine_tuning/jobs"
BATCH = torch.tensor([[256, 259, 117, 115, 101, 114, 260, 10, 10, 97, 102, 116, 101, 114, 63]])


@pytest.fixture
def backend() -> str:  # the merge is the same on both databases; one is enough
    return "sqlite"


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    from trainers.common.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


def _adapter(base_dir, out) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base_dir)),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                      init_lora_weights=False))
    model.save_pretrained(str(out))


def test_merged_export_loads_in_transformers_with_the_logits_of_base_plus_adapter(
        client, tenant_key, make_job, db_session, settings, inline_queue, tiny_base, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    shutil.rmtree(settings.models_dir / "tiny-llama")  # the registry's demo model is this one here
    os.symlink(tiny_base, settings.models_dir / "tiny-llama")
    owner, stranger = tenant_key(), tenant_key()
    job_id = make_job(owner.headers)["id"]
    row, token = start_running(db_session, job_id)
    output = settings.data_path / "artifacts" / job_id / "output"
    _adapter(tiny_base, output / "adapter")
    files = [{"name": f"adapter/{p.name}", "bytes": p.stat().st_size,
              "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in (output / "adapter").iterdir()]
    client.post(f"/internal/v1/jobs/{job_id}/reports", headers={"Authorization": f"Bearer {token}"},
                json={"seq": 0, "items": [{"type": "artifacts", "location": str(output), "files": files}]})
    url = f"{JOBS}/{job_id}/exports"
    early = client.post(url, headers=owner.headers, json={"format": "merged"})
    assert early.status_code == 409 and early.json()["error"]["code"] == "job_not_succeeded"
    db_session.refresh(row)
    transition(db_session, row, "succeeded", actor="executor")
    db_session.commit()

    assert client.post(url, headers=stranger.headers, json={"format": "merged"}).status_code == 404
    assert client.post(url, headers=owner.headers, json={"format": "gguf"}).status_code == 400
    missing = client.post(url, headers=owner.headers, json={"format": "merged", "checkpoint": "ftckpt-nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "checkpoint_not_found"
    created = client.post(url, headers=owner.headers, json={"format": "merged", "dtype": "float32"})
    assert created.status_code == 200, created.text  # like a job: created, status queued
    export = created.json()
    assert export["object"] == "fine_tuning.job.export" and export["artifacts_prefix"] == f"exports/{export['id']}/"
    sent = [args for name, args, _ in inline_queue.sent if name == "tunefleet.export_merged"]
    assert sent == [(job_id, export["id"], "float32", None)]

    monkeypatch.setattr(exports, "MAX_SHARD_SIZE", "100KB")  # the tiny model in several shards
    assert exports.run_merged_export(settings, *sent[0]) == "succeeded"

    listing = client.get(f"{JOBS}/{job_id}/artifacts", headers=owner.headers).json()["data"]
    merged = {a["name"].removeprefix(export["artifacts_prefix"]): a for a in listing
              if a["name"].startswith(export["artifacts_prefix"])}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "README.md"} <= set(merged)
    assert sum(name.endswith(".safetensors") for name in merged) > 1
    download = tmp_path / "merged"
    download.mkdir()
    for name, item in merged.items():
        body = client.get(f"{JOBS}/{job_id}/artifacts/{item['name']}", headers=owner.headers).content
        assert hashlib.sha256(body).hexdigest() == item["sha256"]
        (download / name).write_bytes(body)

    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(str(download), dtype=torch.float32)(BATCH).logits
        base = AutoModelForCausalLM.from_pretrained(str(tiny_base), dtype=torch.float32)
        base_logits = base(BATCH).logits
        reference = PeftModel.from_pretrained(base, str(output / "adapter")).eval()(BATCH).logits
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
    assert (reference - base_logits).abs().max() > 1e-3  # the adapter is in there
    assert "base_model: \"tunefleet-tiny-llama\"" in (download / "README.md").read_text()
    events = [e["message"] for e in client.get(f"{JOBS}/{job_id}/events?limit=100", headers=owner.headers).json()["data"]]
    assert any(m.startswith(f"Merged export {export['id']} ready") for m in events), events
    assert any(m == f"Merged export {export['id']} started (float32)" for m in events)
