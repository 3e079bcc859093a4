"""Tool-calling, content-parts and ShareGPT files really train, driven by the official
``openai`` SDK against the real service (API, Celery worker, scheduler, trainer
processes; SQLite + the server-less broker): each file validates and its short job
succeeds (the content-parts one on jax_lora, the others on fsdp_qlora), having trained
on exactly the tokens the shared data pipeline renders."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
from openai import OpenAI

from tests.chat_files import content_parts_lines, sharegpt_lines, tool_calling_lines

pytestmark = pytest.mark.slow

MAX_SEQ_LEN = 512  # the demo model's limit; the tool-calling lines render to at most 507 tokens
FILES = {"tool_calls": tool_calling_lines(8), "content_parts": content_parts_lines(8), "sharegpt": sharegpt_lines(8)}
# Both trainers read the files through the same data pipeline: one job of each is enough.
TRAINERS = {"tool_calls": "fsdp_qlora", "content_parts": "jax_lora", "sharegpt": "fsdp_qlora"}


def _expected_tokens(tiny_model_dir: Path, body: bytes) -> int:
    from transformers import AutoTokenizer

    from trainers.common.data import tokenize_dataset
    from trainers.common.formats import read_examples

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ds = tokenize_dataset(tok, read_examples(body.decode().splitlines()), MAX_SEQ_LEN)
    assert ds.n_truncated == 0
    return ds.n_tokens


def test_tool_call_content_parts_and_sharegpt_jobs_succeed(service, tiny_model_dir: Path) -> None:
    svc = service("embedded")
    oai = OpenAI(api_key=svc.admin_key, base_url=f"{svc.base_url}/v1", max_retries=0, timeout=30.0)
    jobs = {}
    for name, body in FILES.items():
        uploaded = oai.files.create(file=(f"{name}.jsonl", io.BytesIO(body)), purpose="fine-tune")
        deadline = time.monotonic() + 60
        while oai.files.retrieve(uploaded.id).status == "uploaded" and time.monotonic() < deadline:
            time.sleep(0.3)
        assert oai.files.retrieve(uploaded.id).status == "processed", name
        jobs[name] = oai.fine_tuning.jobs.create(
            model="tunefleet-tiny-llama", training_file=uploaded.id, seed=5, suffix=name.replace("_", "-"),
            hyperparameters={"n_epochs": 1, "batch_size": 4},
            extra_body={"adapter": {"r": 4}, "max_seq_len": MAX_SEQ_LEN, "trainer": TRAINERS[name]},
        )

    deadline = time.monotonic() + 420
    done = {}
    while len(done) < len(jobs) and time.monotonic() < deadline:
        for name, job in jobs.items():
            current = oai.fine_tuning.jobs.retrieve(job.id)
            if current.status in ("succeeded", "failed", "cancelled"):
                done[name] = current
        time.sleep(1.0)
    assert set(done) == set(jobs), f"not finished in time: {set(jobs) - set(done)}\n{svc.dump_logs()}"

    for name, job in done.items():
        assert job.status == "succeeded", f"{name}: {job.error}\n{svc.dump_logs()}"
        assert job.fine_tuned_model and job.trained_tokens
        assert job.model_extra["trainer"] == TRAINERS[name]
        events = oai.fine_tuning.jobs.list_events(job.id, limit=100).data
        # fsdp_qlora says "model loaded", jax_lora "jax_lora: model loaded"; both carry the data stats
        (loaded,) = [e for e in events if e.message.endswith("model loaded")]
        stats = loaded.data
        assert (stats["train_examples"], stats["truncated_examples"], stats["dropped_examples"]) == (8, 0, 0), stats
        assert stats["train_tokens"] == _expected_tokens(tiny_model_dir, FILES[name]), name
        assert [c.step_number for c in oai.fine_tuning.jobs.checkpoints.list(job.id).data], name
