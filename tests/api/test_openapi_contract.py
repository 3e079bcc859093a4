"""The API answers as ``/openapi.json`` says: schemathesis against the in-process app.

Schemathesis reads the app's own document and sends generated requests (valid ones, and
ones the schema says are invalid) through the ASGI app, checking every answer: no 5xx, a
documented status, the documented media type and body schema, and invalid input refused
with a 4xx. Examples per operation are bounded so the module takes about a minute.

- with an admin key: the coverage phase (boundary values, wrong types, unexpected
  methods, which must be a 405 with ``Allow``), random fuzzing, and the stateful phase
  (chains of calls linked through the ids the answers return);
- without a key: fuzzing, where every authenticated operation must answer its documented
  401 whatever the request looks like.

``positive_data_acceptance`` is left out: a schema-valid body may still name a file or a
model that does not exist, which is a documented 400. The SSE stream is left out (it
stays open until its job ends).

The plain regression tests below pin each contract finding on its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import schemathesis
from schemathesis import engine
from schemathesis.engine import events


@pytest.fixture
def backend() -> str:
    return "sqlite"  # the contract does not depend on the database; once is enough


def run_schemathesis(app: Any, *, headers: dict[str, str], phases: dict[str, Any],
                     max_examples: int) -> list[str]:
    """Run the engine over the app; one line per distinct (operation, check) failure."""
    config = schemathesis.Config.from_dict({
        "seed": 20261201, "workers": 1, "suppress-health-check": ["all"],
        "headers": headers,
        "generation": {"max-examples": max_examples, "mode": "all", "database": "none"},
        "checks": {"positive_data_acceptance": {"enabled": False}},
        "phases": phases,
    })
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
    schema = schema.exclude(path_regex="/stream$")
    failures: dict[tuple[str, str], str] = {}
    for event in engine.from_schema(schema).execute():
        if isinstance(event, events.FatalError):
            raise event.exception
        if isinstance(event, events.NonFatalError):
            failures[(event.label, "error")] = repr(event.value)
        if isinstance(event, events.ScenarioFinished):
            for nodes in event.recorder.checks.values():
                for node in nodes:
                    if node.failure_info is not None:
                        failures.setdefault((event.recorder.label, node.name),
                                            node.failure_info.failure.message[:500])
    return [f"{label} [{check}]: {message}" for (label, check), message in failures.items()]


@contextmanager
def worker_beating(settings: Any) -> Iterator[None]:
    """Beat like a live worker, so ``/readyz`` is ready (its 503 is tested with the health
    checks): a 5xx anywhere else fails the contract."""
    from control.worker_heartbeat import beat

    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            beat(settings)
            stop.wait(5)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_the_api_keeps_its_documented_contract(app, admin_key, settings) -> None:
    with worker_beating(settings):
        problems = _contract_problems(app, admin_key)
    assert not problems, "\n\n".join(problems)


def _contract_problems(app: Any, admin_key: str) -> list[str]:
    problems = run_schemathesis(
        app, headers={"Authorization": f"Bearer {admin_key}"}, max_examples=5,
        phases={"examples": {"enabled": False}, "stateful": {"enabled": True, "max-steps": 10}},
    )
    problems += run_schemathesis(
        app, headers={}, max_examples=5,
        phases={"examples": {"enabled": False}, "coverage": {"enabled": False},
                "stateful": {"enabled": True, "max-steps": 5}},
    )
    return problems


# ---- the findings, one by one -------------------------------------------------------------


def _operations(document: dict[str, Any]):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            yield f"{method.upper()} {path}", operation


def test_the_document_lists_real_statuses_with_the_error_envelope(client) -> None:
    document = client.get("/openapi.json").json()
    envelope = {"$ref": "#/components/schemas/ErrorResponse"}
    for label, operation in _operations(document):
        responses = operation["responses"]
        assert "422" not in responses, label
        for status, response in responses.items():
            if status[0] in "45" and label != "GET /readyz":  # readiness answers its checks
                assert response["content"] == {"application/json": {"schema": envelope}}, label
        if label.startswith(("GET /v1/", "POST /v1/", "DELETE /v1/", "PATCH /v1/")):
            assert "401" in responses, label
        content = responses["200"]["content"]
        assert content, label
        if "application/json" in content:
            assert content["application/json"]["schema"], f"{label}: no response_model"
    error = document["components"]["schemas"]["ErrorObject"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in document["components"]["schemas"]
    ops = dict(_operations(document))
    assert "409" in ops["DELETE /v1/files/{file_id}"]["responses"]
    assert "413" in ops["POST /v1/files"]["responses"]
    assert "403" in ops["POST /v1/admin/tenants"]["responses"]
    assert set(ops["POST /internal/v1/jobs/{job_id}/reports"]["responses"]) >= {"400", "401", "404"}


def test_the_document_declares_the_upload_body_and_real_media_types(client) -> None:
    ops = dict(_operations(client.get("/openapi.json").json()))
    upload = ops["POST /v1/files"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert upload["required"] == ["purpose", "file"]
    assert upload["properties"]["file"]["format"] == "binary"

    def media(label: str) -> set[str]:
        return set(ops[label]["responses"]["200"]["content"])

    assert media("GET /v1/files/{file_id}/content") == {"application/jsonl", "text/csv"}
    assert media("GET /v1/fine_tuning/jobs/{job_id}/artifacts/{name}") == {"application/octet-stream"}
    assert media("GET /v1/fine_tuning/jobs/{job_id}/stream") == {"text/event-stream"}
    assert media("GET /v1/fine_tuning/jobs/{job_id}/logs") == {"text/plain"}


def test_the_document_states_the_bounds_the_server_enforces(client, admin_key) -> None:
    text = client.get("/openapi.json").text
    assert "4.611686018427388e+18" not in text and "2147483647.0" not in text
    ops = dict(_operations(client.get("/openapi.json").json()))
    # OpenAI's list files pages up to 10,000 files; its other lists up to 100 objects.
    for label, most in (("GET /v1/files", 10_000), ("GET /v1/fine_tuning/jobs", 100), ("GET /v1/webhooks", 100)):
        limit = next(p for p in ops[label]["parameters"] if p["name"] == "limit")["schema"]
        assert (limit["minimum"], limit["maximum"]) == (1, most), label
    headers = {"Authorization": f"Bearer {admin_key}"}
    assert client.get("/v1/files?limit=10001", headers=headers).status_code == 400
    assert client.get("/v1/files?limit=10000", headers=headers).status_code == 200
    assert client.get("/v1/fine_tuning/jobs?limit=101", headers=headers).status_code == 400
    start = next(p for p in ops["GET /v1/usage"]["parameters"] if p["name"] == "start")
    assert "pattern" in start["schema"]["anyOf"][0]
    for good in ("1764423123", "2026-12-01", "2026-12-01T10:00:00Z"):
        assert client.get(f"/v1/usage?start={good}", headers=headers).status_code == 200, good
    answer = client.get("/v1/usage?start=yesterday", headers=headers)
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "start")


def test_405_lists_every_method_of_the_path(client, admin_key) -> None:
    answer = client.delete("/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {admin_key}"})
    assert answer.status_code == 405
    assert answer.json()["error"]["code"] == "method_not_allowed"
    assert {m.strip() for m in answer.headers["allow"].split(",")} >= {"GET", "POST"}
    answer = client.put("/v1/files/file-x")
    assert {m.strip() for m in answer.headers["allow"].split(",")} >= {"GET", "DELETE"}


def test_a_body_that_is_not_utf8_is_invalid_json(client, admin_key) -> None:
    answer = client.post(
        "/v1/fine_tuning/jobs", content='{"model": "é"}'.encode("latin-1"),
        headers={"Authorization": f"Bearer {admin_key}", "Content-Type": "application/json"},
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("body", [b"{not json", '{"x": "é"}'.encode("latin-1"), b'{"model": 1}'])
def test_no_key_is_a_401_whatever_the_body(client, body: bytes) -> None:
    answer = client.post("/v1/fine_tuning/jobs", content=body,
                         headers={"Content-Type": "application/json"})
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["code"] == "missing_api_key"


@pytest.mark.parametrize("body", [b"{not json", b'{"seq": "x"}'])
def test_the_report_route_checks_the_job_token_before_the_body(client, body: bytes) -> None:
    answer = client.post("/internal/v1/jobs/ftjob-x/reports", content=body,
                         headers={"Content-Type": "application/json"})
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["code"] == "invalid_job_token"


def test_a_whole_float_is_an_integer_and_other_floats_are_not(client, make_job, tenant_key) -> None:
    key = tenant_key()
    job = make_job(key.headers, hyperparameters={"n_epochs": 2.0, "batch_size": 4.0})
    assert (job["hyperparameters"]["n_epochs"], job["hyperparameters"]["batch_size"]) == (2, 4)
    answer = client.post("/v1/fine_tuning/jobs", headers=key.headers, json={
        "model": "tunefleet-tiny-llama", "training_file": "file-x",
        "hyperparameters": {"n_epochs": 2.5},
    })
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "hyperparameters.n_epochs"
    answer = client.post("/v1/fine_tuning/jobs", headers=key.headers, json={
        "model": "tunefleet-tiny-llama", "training_file": "file-x", "seed": "3",
    })
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "seed")


@pytest.mark.parametrize("value", [0, 1, "true", None])
def test_is_admin_takes_only_a_json_boolean(client, admin_key, value: Any) -> None:
    headers = {"Authorization": f"Bearer {admin_key}"}
    answer = client.post("/v1/admin/tenants", headers=headers,
                         json={"name": f"strict-{value!r}", "is_admin": value})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "is_admin"
    tenant = client.post("/v1/admin/tenants", headers=headers,
                         json={"name": f"ok-{value!r}", "is_admin": False}).json()
    answer = client.post(f"/v1/admin/tenants/{tenant['id']}/api_keys", headers=headers,
                         json={"is_admin": value})
    assert answer.status_code == 400, answer.text


# OpenAI's published OpenAPI document (openai/openai-openapi): the properties each object
# and request body requires, as that document lists them.
OPENAI_REQUIRED = {
    "UploadPublic": {"bytes", "created_at", "expires_at", "filename", "id", "purpose", "status"},
    "UploadPartPublic": {"created_at", "id", "object", "upload_id"},
    "CheckpointPermissionPublic": {"created_at", "id", "object", "project_id"},
    "CheckpointPermissionDeleted": {"id", "object", "deleted"},
    "UploadCreate": {"filename", "purpose", "bytes", "mime_type"},
    "UploadComplete": {"part_ids"},
    "PermissionCreate": {"project_ids"},
}


def test_uploads_and_checkpoint_permissions_are_documented_as_openai_types_them(client) -> None:
    document = client.get("/openapi.json").json()
    schemas, ops = document["components"]["schemas"], dict(_operations(document))
    for name, required in OPENAI_REQUIRED.items():
        assert required <= set(schemas[name]["required"]), name
    assert set(schemas["UploadPublic"]["properties"]["status"]["enum"]) == {"pending", "completed", "cancelled",
                                                                            "expired"}
    for name, kind in (("UploadPublic", "upload"), ("UploadPartPublic", "upload.part"),
                       ("CheckpointPermissionPublic", "checkpoint.permission")):
        assert schemas[name]["properties"]["object"]["const"] == kind

    part = ops["POST /v1/uploads/{upload_id}/parts"]
    body = part["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert body["required"] == ["data"] and body["properties"]["data"]["format"] == "binary"
    assert {"400", "401", "404", "409", "413"} <= set(part["responses"])
    assert {"400", "404", "409"} <= set(ops["POST /v1/uploads/{upload_id}/complete"]["responses"])
    permissions = "/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions"
    listed = {p["name"]: p["schema"] for p in ops[f"GET {permissions}"]["parameters"]}
    assert listed["limit"]["default"] == 10 and listed["order"]["default"] == "descending"
    assert set(listed["order"]["enum"]) == {"ascending", "descending"} and "project_id" in listed
    assert {"403", "404"} <= set(ops[f"DELETE {permissions}/{{permission_id}}"]["responses"])
