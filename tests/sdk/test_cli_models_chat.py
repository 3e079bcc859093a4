"""`tunefleet models register/get`, `tunefleet chat` and `tunefleet jobs evaluate` against
the running service.

The chat (and an evaluation's answers) go through the service's inference proxy to a
small fake of vLLM (tests/fake_vllm.py), which answers "<model> says hi" and records what
it was sent, so the test sees the body the CLI built and the tokens it streamed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fake_vllm import FakeVLLM
from tests.sdk.conftest import DEMO_MODEL, JobDriver, Service, chat_jsonl, queued_job

# What the CLI sends does not depend on the database: one backend is enough here.
pytestmark = pytest.mark.parametrize("backend", ["sqlite"])


@pytest.fixture
def vllm() -> FakeVLLM:
    return FakeVLLM(served=(DEMO_MODEL,))


@pytest.fixture
def settings(settings: Any, vllm: FakeVLLM, live_server: Any, tmp_path: Path) -> Any:
    """The demo model served by the fake vLLM server (the registry's ``inference_url``)."""
    registry = tmp_path / "models.yaml"
    registry.write_text(yaml.safe_dump({"models": [
        {"id": DEMO_MODEL, "path": str(settings.models_dir / "tiny-llama"), "inference_url": live_server(vllm.app)}]}))
    return settings.model_copy(update={"base_models_file": registry})


def test_models_register_and_get(cli: Any, service: Service, admin_key: str) -> None:
    source = str(service.settings.models_dir / "tiny-llama")
    denied = cli("models", "register", source, "--id", "acme/tiny", "--json", code=1)
    assert json.loads(denied.stderr)["error"]["code"] == "permission_denied"

    admin = ("--api-key", admin_key)
    model = json.loads(cli("models", "register", source, "--id", "acme/tiny", "--hf-id", "acme/tiny-hf",
                           "--json", *admin).stdout)
    assert (model["id"], model["kind"], model["status"], model["architecture"]) == (
        "acme/tiny", "base", "ready", "llama")
    taken = cli("models", "register", source, "--id", "acme/tiny", *admin, code=1)
    assert "model_exists" in taken.stderr

    got = json.loads(cli("models", "get", "acme/tiny", "--json").stdout)
    assert got["id"] == "acme/tiny" and got["status"] == "ready" and got.get("source") is None
    human = cli("models", "get", "acme/tiny", *admin).stdout
    assert "ready" in human and "llama" in human and source in human
    listed = [m["id"] for m in json.loads(cli("models", "--json").stdout)["data"]]
    assert listed == [m["id"] for m in json.loads(cli("models", "list", "--json").stdout)["data"]]
    assert {"acme/tiny", DEMO_MODEL} <= set(listed)
    assert "acme/tiny" in cli("models").stdout
    missing = cli("models", "get", "nope", "--json", code=1)
    assert json.loads(missing.stderr)["error"]["code"] == "not_found"


def test_chat_prints_the_answer(cli: Any, vllm: FakeVLLM) -> None:
    answer = cli("chat", DEMO_MODEL, "What is 2+2?", "--system", "Be brief.", "--max-tokens", "5")
    assert answer.stdout == f"{DEMO_MODEL} says hi\n"
    (sent,) = [body for kind, body in vllm.calls if kind == "chat"]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is 2+2?"}]
    assert sent["max_tokens"] == 5 and sent["temperature"] == 0

    completion = json.loads(cli("chat", DEMO_MODEL, "-", "--json", input="from stdin\n").stdout)
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"]["content"] == f"{DEMO_MODEL} says hi"
    assert vllm.calls[-1][1]["messages"] == [{"role": "user", "content": "from stdin\n"}]

    streamed = cli("chat", DEMO_MODEL, "hi", "--stream", "--temperature", "0.7")
    assert streamed.stdout == f"{DEMO_MODEL} says hi\n"
    assert vllm.calls[-1][1]["stream"] is True and vllm.calls[-1][1]["temperature"] == 0.7
    chunks = [json.loads(line) for line in cli("chat", DEMO_MODEL, "hi", "--stream", "--json").stdout.splitlines()]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == (
        f"{DEMO_MODEL} says hi")

    unknown = cli("chat", "nope", "hi", "--json", code=1)
    assert json.loads(unknown.stderr)["error"]["status"] == 404
    assert "no prompt" in cli("chat", DEMO_MODEL, "-", input="", code=2).stderr


def test_jobs_evaluate_asks_the_base_and_the_fine_tuned_model(cli: Any, service: Service, vllm: FakeVLLM,
                                                              tmp_path: Path) -> None:
    """An evaluation of a job whose base model an inference server serves (the proxy path):
    the adapter is loaded there once, each row is asked greedily of both models, and a
    grader given as a file tells them apart (the fake answers "<model> says hi")."""
    job = queued_job(service)
    driver = JobDriver(service, job)
    driver.start()
    driver.report(driver.write_outputs({"adapter/adapter_model.safetensors": b"w",
                                        "adapter/adapter_config.json": b"{}"}))
    driver.finish("succeeded")
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_bytes(chat_jsonl(4))
    grader = tmp_path / "grader.json"
    grader.write_text(json.dumps({"type": "string_check", "name": "fine-tuned answered", "operation": "like",
                                  "input": "{{sample.output_text}}", "reference": "ft:"}))

    shown = cli("jobs", "evaluate", job, "--file", str(held_out), "--max-samples", "3", "--grader", f"@{grader}")
    assert "held-out fine-tuned answered on 3 rows of file-" in shown.stdout
    assert "base 0% -> fine-tuned 100%" in shown.stdout and "says hi" in shown.stdout
    asked = [body for kind, body in vllm.calls if kind == "chat"]
    fine_tuned = next(m["id"] for m in json.loads(cli("models", "--json").stdout)["data"] if m["id"].endswith(job))
    assert [body["model"] for body in asked] == [DEMO_MODEL] * 3 + [fine_tuned] * 3
    assert {(body["temperature"], body["max_completion_tokens"]) for body in asked} == {(0.0, 64)}
    assert asked[0]["messages"] == [{"role": "user", "content": "What is 0 plus 0?"}]
    assert [kind for kind, _ in vllm.calls].count("load") == 1

    first = json.loads(cli("jobs", "evaluations", job, "--json").stdout)["data"][0]
    queued = json.loads(cli("jobs", "evaluate", job, "--file", first["file"], "--no-wait", "--json").stdout)
    assert queued["status"] == "queued" and queued["grader"]["name"] == "exact_match"
    listed = [e["id"] for e in json.loads(cli("jobs", "evaluations", job, "--json").stdout)["data"]]
    assert listed == [queued["id"], first["id"]]
    table = cli("jobs", "evaluations", job).stdout
    assert "fine-tuned answered" in table and "100%" in table
    refused = cli("jobs", "evaluate", queued_job(service), "--file", queued["file"], "--json", code=1)
    assert json.loads(refused.stderr)["error"]["code"] == "job_not_succeeded"
