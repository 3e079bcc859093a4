"""The objects the service answers validate against OpenAI's published schemas.

``openai_schemas/objects.json`` holds the schemas, extracted from OpenAI's OpenAPI document
by ``openai_schemas/extract.py``. The probe: a file's ``status_details`` and ``expires_at``,
an event's ``data``, a checkpoint's ``metrics.valid_loss`` and
``metrics.train_mean_token_accuracy`` and a chat completion's ``system_fingerprint`` were
``null`` where OpenAI types a string, integer, object or number; an empty file list had
``null`` for the ``first_id`` / ``last_id`` strings it requires; and ``batch_size: 512``
was accepted and served although OpenAI caps it at 256.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from tests.api.conftest import start_running

SCHEMAS = json.loads((Path(__file__).parent / "openai_schemas" / "objects.json").read_text(encoding="utf-8"))


def openai_errors(instance: Any, name: str) -> list[str]:
    """How ``instance`` breaks OpenAI's schema ``name`` (empty when it conforms)."""
    validator = Draft202012Validator({"$defs": SCHEMAS["$defs"], "$ref": f"#/$defs/{name}"})
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(instance)]


def test_files_and_an_empty_file_list_are_openai_files(client, tenant_key, processed_file) -> None:
    headers = tenant_key().headers
    assert openai_errors(client.get("/v1/files", headers=headers).json(), "ListFilesResponse") == []
    file_id = processed_file(headers)
    assert openai_errors(client.get(f"/v1/files/{file_id}", headers=headers).json(), "OpenAIFile") == []
    assert openai_errors(client.get("/v1/files", headers=headers).json(), "ListFilesResponse") == []


def test_events_and_checkpoints_are_openai_objects(client, tenant_key, make_job, db_session) -> None:
    headers = tenant_key().headers
    job_id = make_job(headers)["id"]
    _row, token = start_running(db_session, job_id)
    location = f"{client.app.state.settings.resolved_artifact_url}/{job_id}/checkpoints/step-1"
    reported = client.post(f"/internal/v1/jobs/{job_id}/reports", headers={"Authorization": f"Bearer {token}"},
                           json={"seq": 0, "items": [
                               {"type": "event", "level": "info", "message": "no data"},
                               {"type": "checkpoint", "step": 1, "location": location,
                                "metrics": {"train_loss": 2.4, "valid_loss": None, "token_accuracy": None}}]})
    assert reported.status_code == 200, reported.text
    events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", headers=headers).json()
    assert len(events["data"]) >= 2
    assert openai_errors(events, "ListFineTuningJobEventsResponse") == []
    checkpoints = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=headers).json()
    assert checkpoints["data"][0]["metrics"]["train_loss"] == 2.4
    assert openai_errors(checkpoints, "ListFineTuningJobCheckpointsResponse") == []


@pytest.mark.parametrize(("method", "param"), [
    (None, "hyperparameters.batch_size"),
    ({"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 512}}},
     "method.supervised.hyperparameters.batch_size"),
    ({"type": "dpo", "dpo": {"hyperparameters": {"batch_size": 512}}}, "method.dpo.hyperparameters.batch_size"),
])
def test_batch_size_is_capped_at_openais_256(client, tenant_key, processed_file, method, param) -> None:
    headers = tenant_key().headers
    body: dict[str, Any] = {"model": "tunefleet-tiny-llama", "training_file": processed_file(headers)}
    body.update({"method": method} if method else {"hyperparameters": {"batch_size": 512}})
    response = client.post("/v1/fine_tuning/jobs", headers=headers, json=body)
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("invalid_request", param)


def test_served_hyperparameters_are_openais(client, tenant_key, make_job) -> None:
    headers = tenant_key().headers
    job = make_job(headers, hyperparameters={"batch_size": 256, "n_epochs": 2})
    hyperparameters = job["method"]["supervised"]["hyperparameters"]
    assert hyperparameters["batch_size"] == 256
    assert openai_errors(hyperparameters, "FineTuneSupervisedHyperparameters") == []


def test_chat_completions_and_their_chunks_are_openai_objects() -> None:
    from api.inference.completions import _Chunks

    chunks = _Chunks("chat", "tunefleet-tiny-llama")
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert openai_errors(chunks.complete([("hi", "stop")], usage), "CreateChatCompletionResponse") == []
    streamed = [chunks.chunk(0, role=True, usage=False), chunks.chunk(0, text="hi", usage=False),
                chunks.chunk(0, finish_reason="stop", usage=False)]
    assert [openai_errors(chunk, "CreateChatCompletionStreamResponse") for chunk in streamed] == [[], [], []]
