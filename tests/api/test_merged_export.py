"""Merged exports: ``POST .../exports`` queues the merge, the task (run here inline, as a worker
runs it) writes sharded safetensors that ``AutoModelForCausalLM`` loads with the logits of
base + adapter under peft (1e-4, fp32); progress and result are job events."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch

from control.jobs.lifecycle import transition
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
    events = [e["message"]
              for e in client.get(f"{JOBS}/{job_id}/events?limit=100", headers=owner.headers).json()["data"]]
    assert any(m.startswith(f"Merged export {export['id']} ready") for m in events), events
    assert any(m == f"Merged export {export['id']} started (float32)" for m in events)
    # The same export asked for again is the finished one: no second copy of the model.
    again = client.post(url, headers=owner.headers, json={"format": "merged", "dtype": "float32"})
    assert again.status_code == 200 and again.json() | {"status": "queued"} == export
    assert again.json()["status"] == "succeeded"
    assert len([name for name, _, _ in inline_queue.sent if name == "tunefleet.export_merged"]) == 1


# ---- one export per adapter at a time, a cap per tenant, a finished one reused -------------


@pytest.fixture
def succeeded_job(client, tenant_key, make_job, db_session, settings):
    """``make(key=None) -> (job id, owner headers)``: a succeeded job with a registered final
    adapter (its files are not read before the merge runs)."""

    def make(owner=None):
        owner = owner or tenant_key()
        job_id = make_job(owner.headers)["id"]
        row, token = start_running(db_session, job_id)
        output = settings.data_path / "artifacts" / job_id / "output"
        answer = client.post(f"/internal/v1/jobs/{job_id}/reports", headers={"Authorization": f"Bearer {token}"},
                             json={"seq": 0, "items": [{"type": "artifacts", "location": str(output), "files": [
                                 {"name": "adapter/adapter_model.safetensors", "bytes": 1, "sha256": "a" * 64}]}]})
        assert answer.status_code == 200, answer.text
        db_session.refresh(row)
        transition(db_session, row, "succeeded", actor="executor")
        db_session.commit()
        return job_id, owner

    return make


def export_tasks(inline_queue) -> list[tuple]:
    return [args for name, args, _ in inline_queue.sent if name == "tunefleet.export_merged"]


def test_back_to_back_requests_share_one_export(client, succeeded_job, inline_queue) -> None:
    """The probe: 12 back-to-back POSTs made 12 full copies of the model."""
    job_id, owner = succeeded_job()
    answers = [client.post(f"{JOBS}/{job_id}/exports", headers=owner.headers, json={"format": "merged"})
               for _ in range(12)]
    assert {a.status_code for a in answers} == {200}
    assert len({a.json()["id"] for a in answers}) == 1
    assert answers[-1].json()["status"] == "queued"
    assert len(export_tasks(inline_queue)) == 1
    # Another dtype of the same adapter waits for this one to end.
    other = client.post(f"{JOBS}/{job_id}/exports", headers=owner.headers,
                        json={"format": "merged", "dtype": "float32"})
    assert other.status_code == 409 and other.json()["error"]["code"] == "export_in_progress"
    assert answers[0].json()["id"] in other.json()["error"]["message"]


def test_a_tenant_runs_a_bounded_number_of_exports_at_once(client, succeeded_job, tenant_key,
                                                           inline_queue, settings) -> None:
    owner = tenant_key()
    jobs = [succeeded_job(owner)[0] for _ in range(settings.export_max_concurrent_per_tenant + 1)]
    statuses = [client.post(f"{JOBS}/{j}/exports", headers=owner.headers, json={"format": "merged"})
                for j in jobs]
    assert [a.status_code for a in statuses[:-1]] == [200] * (len(jobs) - 1)
    refused = statuses[-1]
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_exports"
    assert refused.headers["retry-after"].isdigit()
    # Another tenant's exports are its own.
    job_id, stranger = succeeded_job()
    assert client.post(f"{JOBS}/{job_id}/exports", headers=stranger.headers,
                       json={"format": "merged"}).status_code == 200


def test_a_failed_export_can_be_asked_for_again(client, succeeded_job, inline_queue, settings) -> None:
    job_id, owner = succeeded_job()
    first = client.post(f"{JOBS}/{job_id}/exports", headers=owner.headers, json={"format": "merged"}).json()
    # The adapter's files were never written: the merge fails, as a worker would run it.
    assert exports.run_merged_export(settings, *export_tasks(inline_queue)[0]) == "failed"
    shown = client.post(f"{JOBS}/{job_id}/exports", headers=owner.headers, json={"format": "merged"}).json()
    assert shown["id"] != first["id"] and shown["status"] == "queued"
    assert len(export_tasks(inline_queue)) == 2
