"""A job submitted over HTTP really trains on this machine, and survives faults.

The real processes (API, Celery worker, scheduler loop, trainer subprocesses) run on
both backends: SQLite + the server-less broker, and PostgreSQL + Redis. The base model is
the demo's tiny random Llama; the data is the demo's capital-city task.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import signal
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tunefleet.demo import demo_examples

pytestmark = pytest.mark.slow

TERMINAL = {"succeeded", "failed", "cancelled"}


def upload(http: httpx.Client, examples: list[dict[str, Any]], name: str = "train.jsonl") -> str:
    body = "".join(json.dumps(e) + "\n" for e in examples).encode()
    resp = http.post("/files", data={"purpose": "fine-tune"}, files={"file": (name, body, "application/jsonl")})
    assert resp.status_code == 200, resp.text
    file_id = resp.json()["id"]
    wait_for(lambda: http.get(f"/files/{file_id}").json()["status"] != "uploaded", 60, "file validation")
    assert http.get(f"/files/{file_id}").json()["status"] == "processed"
    return file_id


def create_job(http: httpx.Client, file_id: str, *, n_epochs: int = 1, batch_size: int = 8, seed: int = 7) -> dict:
    resp = http.post("/fine_tuning/jobs", json={
        "model": "tunefleet-tiny-llama",
        "training_file": file_id,
        "seed": seed,
        "hyperparameters": {"n_epochs": n_epochs, "batch_size": batch_size, "learning_rate_multiplier": 20.0},
        "adapter": {"method": "lora", "r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        "max_seq_len": 48,
    })
    assert resp.status_code == 200, resp.text
    return resp.json()


def training_job(http: httpx.Client, examples: list[dict[str, Any]], *, n_epochs: int) -> dict:
    """A job on ``examples`` (batch 4), returned once it has reported its first metrics."""
    job = create_job(http, upload(http, examples), n_epochs=n_epochs, batch_size=4)
    wait_for(lambda: http.get(f"/fine_tuning/jobs/{job['id']}").json().get("current_step"), 180,
             "the first metrics")
    return job


def wait_for(predicate, timeout: float, what: str, interval: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_status(http: httpx.Client, job_id: str, statuses: set[str], timeout: float = 240) -> dict:
    def check() -> dict | None:
        job = http.get(f"/fine_tuning/jobs/{job_id}").json()
        return job if job["status"] in statuses else None
    return wait_for(check, timeout, f"job {job_id} to reach {statuses}")


def all_metrics(http: httpx.Client, job_id: str) -> list[dict]:
    rows: list[dict] = []
    after = None
    while True:
        params: dict[str, Any] = {"limit": 100}
        if after is not None:
            params["after"] = after
        page = http.get(f"/fine_tuning/jobs/{job_id}/metrics", params=params).json()
        rows.extend(page["data"])
        if not page["has_more"]:
            return rows
        after = page["data"][-1]["step"]


def train_losses(rows: list[dict]) -> list[float]:
    return [r["train_loss"] for r in rows]


def assert_contiguous(rows: list[dict], total: int) -> None:
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, total + 1)), f"metric steps not 1..{total} exactly once: {steps}"


def assert_results_file_matches(http: httpx.Client, job: dict, rows: list[dict]) -> None:
    """The job's ``result_files`` CSV (OpenAI's columns) holds exactly the metrics API's rows."""
    assert len(job["result_files"]) == 1, job["result_files"]
    file_id = job["result_files"][0]
    assert http.get(f"/files/{file_id}").json()["purpose"] == "fine-tune-results"
    listed = http.get("/files", params={"purpose": "fine-tune-results", "limit": 100}).json()["data"]
    assert file_id in [f["id"] for f in listed]
    resp = http.get(f"/files/{file_id}/content")
    assert resp.status_code == 200, resp.text

    def cell(value: str) -> float | None:
        return None if value == "" else float(value)

    stored = [(int(r["step"]), cell(r["train_loss"]), cell(r["train_accuracy"]), cell(r["valid_loss"]),
               cell(r["valid_mean_token_accuracy"])) for r in csv.DictReader(io.StringIO(resp.text))]
    assert stored == [(r["step"], r["train_loss"], r["token_accuracy"], r["valid_loss"],
                       r["valid_token_accuracy"]) for r in rows]


def download_adapter(http: httpx.Client, job_id: str, dest: Path) -> None:
    listing = http.get(f"/fine_tuning/jobs/{job_id}/artifacts").json()["data"]
    names = {a["name"]: a for a in listing}
    for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors"):
        assert name in names, f"{name} missing from {sorted(names)}"
        resp = http.get(f"/fine_tuning/jobs/{job_id}/artifacts/{name}", follow_redirects=True)
        assert resp.status_code == 200, resp.text
        assert hashlib.sha256(resp.content).hexdigest() == names[name]["sha256"]
        assert len(resp.content) == names[name]["bytes"]
        target = dest / Path(name).name
        target.write_bytes(resp.content)


def merged_reference_logits(base_dir: Path, adapter_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of the base model with W + (alpha/r)·B·A merged by hand from the safetensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    merged = 0
    for key, a in weights.items():
        if ".lora_A." not in key:
            continue
        b = weights[key.replace(".lora_A.", ".lora_B.")]
        module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
        with torch.no_grad():
            params[f"{module}.weight"] += scaling * (b.float() @ a.float())
        merged += 1
    assert merged > 0
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.parametrize("backend", ["embedded", "postgres"])
def test_submit_train_and_download_a_peft_adapter(service, tiny_model_dir: Path, tmp_path: Path, backend: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    svc = service(backend)
    with svc.http() as http:
        file_id = upload(http, demo_examples(48, seed=1))
        job = create_job(http, file_id, n_epochs=2)
        job = wait_status(http, job["id"], TERMINAL)
        assert job["status"] == "succeeded", svc.dump_logs()
        assert job["fine_tuned_model"]
        assert job["trained_tokens"] > 0

        rows = all_metrics(http, job["id"])
        assert_contiguous(rows, job["total_steps"])
        losses = train_losses(rows)
        assert all(isinstance(x, float) for x in losses)
        assert min(losses[-3:]) < losses[0], f"loss did not fall: {losses}"
        assert_results_file_matches(http, job, rows)

        ckpts = http.get(f"/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
        assert ckpts, "no checkpoint registered"
        assert all(c["object"] == "fine_tuning.job.checkpoint" for c in ckpts)
        assert all("train_loss" in c["metrics"] for c in ckpts)

        events = [e["message"] for e in
                  http.get(f"/fine_tuning/jobs/{job['id']}/events", params={"limit": 100}).json()["data"]]
        assert any("succeeded" in m.lower() for m in events)
        # The executor registers the outputs' manifest again; that adds no second upload event.
        assert sum(m.startswith("Uploaded ") for m in events) == 1, events

        # The run held its slot from admission to its end: one closed usage segment, billed.
        segments = job["usage"]["segments"]
        assert len(segments) == 1 and segments[0]["end"] is not None, job["usage"]
        assert job["usage"]["gpu_seconds"] > 0, job["usage"]
        assert http.get("/usage").json()["gpu_seconds"] >= job["usage"]["gpu_seconds"]

        adapter_dir = tmp_path / "adapter"
        adapter_dir.mkdir()
        download_adapter(http, job["id"], adapter_dir)

        # The model list shows the fine-tuned adapter as a model.
        models = {m["id"] for m in http.get("/models").json()["data"]}
        assert job["fine_tuned_model"] in models

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Capital of Peru?"}],
                                        add_generation_prompt=True, return_tensors="pt")
    input_ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(input_ids).logits
    peft_model = PeftModel.from_pretrained(base, adapter_dir)
    peft_model.eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids).logits
    reference = merged_reference_logits(tiny_model_dir, adapter_dir, input_ids)
    torch.testing.assert_close(peft_logits, reference, atol=1e-4, rtol=0)
    assert (peft_logits - base_logits).abs().max() > 1e-3, "the adapter changes nothing"


def _trainer_pid(svc, job_id: str) -> int | None:
    path = svc.data_dir / "jobs" / job_id / "trainer.pid"
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_killed_trainer_restarts_from_its_checkpoint_and_continues_the_same_curve(service) -> None:
    svc = service("embedded")
    with svc.http() as http:
        file_id = upload(http, demo_examples(32, seed=2))
        # Uninterrupted reference run, then the same job (same seed and data) killed mid-run.
        ref = wait_status(http, create_job(http, file_id, n_epochs=3)["id"], TERMINAL)
        assert ref["status"] == "succeeded", svc.dump_logs()
        job = create_job(http, file_id, n_epochs=3)
        wait_for(lambda: http.get(f"/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"], 180,
                 "a first checkpoint")
        pid = wait_for(lambda: _trainer_pid(svc, job["id"]), 30, "the trainer pid")
        os.killpg(pid, signal.SIGKILL)
        done = wait_status(http, job["id"], TERMINAL)
        assert done["status"] == "succeeded", svc.dump_logs()
        assert done["restarts"] == 1
        events = [e["message"] for e in
                  http.get(f"/fine_tuning/jobs/{job['id']}/events", params={"limit": 100}).json()["data"]]
        # A lost run, requeued through the one outcome path and resumed from its checkpoint.
        assert any(m.startswith("trainer killed by SIGKILL (restart 1 of ") and "step-" in m
                   for m in events), events

        ref_losses = train_losses(all_metrics(http, ref["id"]))
        rows = all_metrics(http, job["id"])
        assert_contiguous(rows, done["total_steps"])
        losses = train_losses(rows)
    assert len(losses) == len(ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses), start=1):
        assert abs(a - b) <= 1e-6, f"step {step}: resumed {a} vs uninterrupted {b}"


def test_api_outage_loses_and_duplicates_no_metric(service) -> None:
    svc = service("embedded")
    with svc.http() as http:
        job = training_job(http, demo_examples(48, seed=3), n_epochs=2)
    svc.stop("api")
    time.sleep(6)  # the trainer keeps training and spools its reports
    svc.start("api")
    with svc.http() as http:
        done = wait_status(http, job["id"], TERMINAL)
        assert done["status"] == "succeeded", svc.dump_logs()
        rows = all_metrics(http, job["id"])
    assert_contiguous(rows, done["total_steps"])
    # Metrics are upserted by step, so the rows above cannot show a batch applied twice.
    # The batches and events can: every seq 1..N was applied exactly once, and each
    # event the trainer sends once (per checkpoint) is stored once.
    with closing(sqlite3.connect(svc.data_dir / "tunefleet.db")) as db:
        seqs = [s for (s,) in db.execute(
            "SELECT seq FROM report_batches WHERE job_id = ? ORDER BY seq", (job["id"],))]
        messages = [m for (m,) in db.execute(
            "SELECT message FROM job_events WHERE job_id = ? ORDER BY seq", (job["id"],))]
    assert len(seqs) > 1 and seqs == list(range(1, len(seqs) + 1)), f"report batch seqs: {seqs}"
    checkpoints = [m for m in messages if m.startswith("Checkpoint created at step ")]
    assert checkpoints and len(checkpoints) == len(set(checkpoints)), checkpoints
    for once in ("trainer started", "model loaded"):
        assert messages.count(once) == 1, (once, messages)
    assert sum(m.startswith("training finished after ") for m in messages) == 1, messages


def test_cancel_a_running_job_keeps_its_checkpoint_and_ends_the_process(service) -> None:
    svc = service("embedded")
    with svc.http() as http:
        job = training_job(http, demo_examples(64, seed=4), n_epochs=20)
        pid = wait_for(lambda: _trainer_pid(svc, job["id"]), 30, "the trainer pid")
        resp = http.post(f"/fine_tuning/jobs/{job['id']}/cancel")
        assert resp.status_code == 200, resp.text
        assert resp.json()["status"] == "cancelled"
        wait_for(lambda: not _alive(pid), 60, "the trainer process to end")
        # SIGTERM made the trainer write a checkpoint before it exited; it is registered.
        ckpts = wait_for(lambda: http.get(f"/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"], 30,
                         "the checkpoint written on SIGTERM")
        assert http.get(f"/fine_tuning/jobs/{job['id']}").json()["status"] == "cancelled"
    ckpt_dir = svc.data_dir / "jobs" / job["id"] / "checkpoints"
    kept = sorted(p.name for p in ckpt_dir.iterdir() if (p / "trainer_state.json").exists())
    assert f"step-{ckpts[0]['step_number']}" in kept, (kept, ckpts[0])


def _events(http: httpx.Client, job_id: str) -> list[str]:
    data = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    return [e["message"] for e in reversed(data)]


@pytest.mark.parametrize("phase", ["loading", "stepping"])
def test_pause_then_resume_at_once_trains_every_step_once(service, phase: str) -> None:
    """Pause and resume 50 ms apart: the old run stops and the job finishes on the new one.

    The old run's exit must not end the new run (it once marked the job succeeded with a
    quarter of its steps): the scheduler starts the new attempt only after the old trainer
    stopped, and every outcome names its attempt.
    """
    svc = service("embedded")
    with svc.http() as http:
        file_id = upload(http, demo_examples(32, seed=5))
        job = create_job(http, file_id, n_epochs=8, batch_size=4)
        if phase == "loading":
            wait_status(http, job["id"], {"running"}, timeout=120)
        else:
            wait_for(lambda: http.get(f"/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"], 180,
                     "a first checkpoint")
        assert http.post(f"/fine_tuning/jobs/{job['id']}/pause").status_code == 200
        time.sleep(0.05)
        resumed = http.post(f"/fine_tuning/jobs/{job['id']}/resume")
        assert resumed.status_code == 200, resumed.text
        done = wait_status(http, job["id"], TERMINAL, timeout=300)
        assert done["status"] == "succeeded", svc.dump_logs()
        rows = all_metrics(http, job["id"])
        assert_contiguous(rows, done["total_steps"])
        events = _events(http, job["id"])
        assert sum(m.startswith("Admitted on pool") for m in events) == 2, events
        segments = done["usage"]["segments"]
        assert len(segments) == 2 and all(s["end"] is not None for s in segments), done["usage"]
