"""Auth and tenant isolation for EVERY route: 401 without/with a bad key, 404 across tenants.

``ROUTES`` lists each route with how to fill its path from tenant A's objects; a test
checks that it covers every route the app serves, so a new route without an entry fails.
"""

from __future__ import annotations

from typing import Any

import pytest

from api.jobs.commands import issue_job_token
from control.db.models import Evaluation, Job
from control.ids import new_id
from control.jobs.lifecycle import transition
from tests.api.conftest import chat_lines, start_running

PUBLIC = {("GET", "/healthz"), ("GET", "/readyz")}

# (method, path template, body) -> tenant-scoped routes (another tenant's objects are 404).
SCOPED: list[tuple[str, str, Any]] = [
    ("GET", "/v1/files/{file_id}", None),
    ("GET", "/v1/files/{file_id}/content", None),
    # Before the file's deletion: an evaluation reads it.
    ("GET", "/v1/fine_tuning/jobs/{job_id}/evaluations", None),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/evaluations/{evaluation_id}", None),
    ("POST", "/v1/fine_tuning/jobs/{job_id}/evaluations", "evaluate"),
    ("DELETE", "/v1/files/{file_id}", None),
    ("GET", "/v1/fine_tuning/jobs/{job_id}", None),
    ("POST", "/v1/fine_tuning/jobs/{job_id}/cancel", None),
    ("POST", "/v1/fine_tuning/jobs/{job_id}/pause", None),
    ("POST", "/v1/fine_tuning/jobs/{job_id}/resume", None),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/events", None),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/checkpoints", None),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/metrics", None),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/logs", None),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/artifacts", None),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/artifacts/{name}", None),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/stream", None),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint_id}/artifacts", None),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint_id}/artifacts/{checkpoint_file}", None),
    ("POST", "/v1/fine_tuning/jobs/{job_id}/exports", {"format": "merged"}),
    ("GET", "/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions", None),
    ("POST", "/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions", "grant"),
    ("DELETE", "/v1/fine_tuning/checkpoints/{fine_tuned_model_checkpoint}/permissions/{permission_id}", None),
    ("GET", "/v1/models/{model_id}", None),
    ("DELETE", "/v1/models/{model_id}", None),  # last: the owner's call deletes the model
]
# Collections: a key sees only its own tenant's entries.
LISTS: list[tuple[str, str, Any]] = [
    ("GET", "/v1/files", None),
    ("POST", "/v1/files", "upload"),
    ("GET", "/v1/fine_tuning/jobs", None),
    ("POST", "/v1/fine_tuning/jobs", "job"),
    ("GET", "/v1/models", None),
    # fleet (tests/api/test_fleet.py): running job ids and usage are the caller's tenant's only
    ("GET", "/v1/node_pools", None),
    ("POST", "/v1/fine_tuning/estimate", {"model": "tunefleet-tiny-llama"}),
    ("GET", "/v1/usage", None),
]
ADMIN: list[tuple[str, str, Any]] = [
    ("GET", "/v1/admin/tenants", None),
    ("POST", "/v1/admin/tenants", {"name": "x"}),
    ("POST", "/v1/admin/tenants/{tenant_id}/api_keys", {}),
    ("DELETE", "/v1/admin/api_keys/{key_id}", None),
    # A base-model registration whose source is not there: past the admin check, the
    # registration itself refuses it (400), so nothing is registered.
    ("POST", "/v1/models", {"id": "registered-x", "source": "/nonexistent/model"}),
]
JOB_TOKEN = [("POST", "/internal/v1/jobs/{job_id}/reports", {"seq": 0, "items": []})]


# The foundation's routers (api/<feature>/routes.py); webhooks, metrics and the dashboard test theirs.
FOUNDATION_TAGS = {"files", "fine-tuning", "fine-tuning outputs", "fine-tuning evaluations", "models", "internal",
                   "admin", "health", "fleet"}


def test_route_table_covers_every_route(app) -> None:
    served = {
        (method.upper(), path)
        for path, operations in app.openapi()["paths"].items()
        for method, operation in operations.items()
        if FOUNDATION_TAGS & set(operation.get("tags", []))
    }
    # A checkpoint's file is the route's {name} too; the table fills it with the checkpoint's own file.
    listed = {(m, p.replace("{checkpoint_file}", "{name}")) for m, p, _ in SCOPED + LISTS + ADMIN + JOB_TOKEN} | PUBLIC
    assert served == listed


@pytest.fixture
def world(client, tenant_key, make_job, settings, db_session):
    """Tenant A with a finished job (adapter, checkpoint, metric, log, the checkpoint shared
    with a third tenant) and B, a stranger."""
    a, b, grantee = tenant_key(), tenant_key(), tenant_key()
    job = make_job(a.headers)
    row, token = start_running(db_session, job["id"])
    out = settings.data_path / "artifacts" / job["id"] / "output"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    checkpoint = settings.job_dir(job["id"]) / "checkpoints" / "step-1"
    (checkpoint / "adapter").mkdir(parents=True)
    (checkpoint / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    report = {"seq": 1, "items": [
        {"type": "metric", "step": 1, "total_steps": 2, "train_loss": 2.0},
        {"type": "checkpoint", "step": 1, "location": str(checkpoint), "metrics": {"train_loss": 2.0}},
        {"type": "artifacts", "location": str(out), "files": [
            {"name": "adapter/adapter_model.safetensors", "bytes": 7, "sha256": "0" * 64}]},
    ]}
    assert client.post(f"/internal/v1/jobs/{job['id']}/reports", json=report,
                       headers={"Authorization": f"Bearer {token}"}).status_code == 200
    db_session.refresh(row)
    transition(db_session, row, "succeeded", actor="executor")
    evaluation = Evaluation(id=new_id("fteval"), job_id=job["id"], tenant_id=a.tenant_id, file_id=job["training_file"],
                            grader={}, max_samples=1, max_tokens=1, status="failed")
    db_session.add(evaluation)
    db_session.commit()
    log = settings.job_dir(job["id"]) / "trainer.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("step 1 loss 2.0\n")
    checkpoints = client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints", headers=a.headers).json()["data"]
    shared = checkpoints[0]["fine_tuned_model_checkpoint"]
    permission = client.post(f"/v1/fine_tuning/checkpoints/{shared}/permissions", headers=a.headers,
                             json={"project_ids": [grantee.tenant_id]}).json()["data"][0]["id"]
    names = {
        "file_id": job["training_file"], "job_id": job["id"],
        "name": "adapter/adapter_model.safetensors", "model_id": row.fine_tuned_model,
        "tenant_id": a.tenant_id, "key_id": "key-x",
        "checkpoint_id": checkpoints[0]["id"], "checkpoint_file": "adapter_model.safetensors",
        "fine_tuned_model_checkpoint": shared, "permission_id": permission, "grantee_id": grantee.tenant_id,
        "evaluation_id": evaluation.id,
    }
    return {"a": a, "b": b, "names": names, "token": token}


def _call(client, method: str, path: str, body: Any, headers: dict[str, str], names: dict[str, str] | None = None):
    if body == "grant":
        body = {"project_ids": [(names or FAKE_NAMES)["grantee_id"]]}
    if body == "upload":
        return client.request(method, path, headers=headers,
                              files={"file": ("t.jsonl", chat_lines(2))},
                              data={"purpose": "fine-tune"})
    if body == "job":
        body = {"model": "tunefleet-tiny-llama", "training_file": "file-x"}
    if body == "evaluate":
        body = {"file": (names or FAKE_NAMES)["file_id"], "max_samples": 1}
    return client.request(method, path, headers=headers, json=body)


FAKE_NAMES = {"file_id": "file-x", "job_id": "ftjob-x", "name": "adapter/a.bin",
              "model_id": "m", "tenant_id": "org-x", "key_id": "key-x",
              "checkpoint_id": "ftckpt-x", "checkpoint_file": "a.bin",
              "fine_tuned_model_checkpoint": "ft:m:org-x:ftjob-x:ckpt-step-1", "permission_id": "cp-x",
              "grantee_id": "org-y", "evaluation_id": "fteval-x"}
BAD_AUTH = ({}, {"Authorization": "Bearer tf_aaaaaaaa_" + "b" * 32},
            {"Authorization": "Basic abc"}, {"Authorization": "Bearer"})


def test_no_key_or_bad_key_is_401(client) -> None:
    for method, template, body in SCOPED + LISTS + ADMIN:
        path = template.format(**FAKE_NAMES)
        for headers in BAD_AUTH:
            response = _call(client, method, path, body, headers)
            assert response.status_code == 401, (path, headers, response.text)
            assert response.json()["error"]["code"] in {"missing_api_key", "invalid_api_key"}


def test_other_tenant_gets_404_and_owner_does_not(client, world) -> None:
    for method, template, body in SCOPED:
        path = template.format(**world["names"])
        response = _call(client, method, path, body, world["b"].headers, world["names"])
        assert response.status_code == 404, (path, response.text)
        assert response.json()["error"]["code"] == "not_found"
    for method, template, body in SCOPED:
        path = template.format(**world["names"])
        owner = _call(client, method, path, body, world["a"].headers, world["names"])
        # The owner gets through (the job has ended, so actions are 409, not 404).
        assert owner.status_code in {200, 409}, (path, owner.text)


def test_lists_show_only_own_objects(client, world) -> None:
    b = world["b"].headers
    assert client.get("/v1/files", headers=b).json()["data"] == []
    assert client.get("/v1/fine_tuning/jobs", headers=b).json()["data"] == []
    models_b = {m["id"] for m in client.get("/v1/models", headers=b).json()["data"]}
    models_a = {m["id"] for m in client.get("/v1/models", headers=world["a"].headers).json()["data"]}
    assert world["names"]["model_id"] in models_a and world["names"]["model_id"] not in models_b
    created = _call(client, "POST", "/v1/fine_tuning/jobs", "job", b)
    assert created.status_code == 400  # file-x is nobody's file: never someone else's job


OPEN_TO_ADMINS = [r for r in SCOPED if r[1].startswith(("/v1/fine_tuning/jobs/", "/v1/fine_tuning/checkpoints/"))]


def test_admin_opens_every_organizations_job_but_not_its_files(client, world, admin_key) -> None:
    """An admin key reads and acts on any organization's job (the dashboard's admin view)
    and manages its checkpoints' permissions; files, models and lists stay per organization."""
    admin = {"Authorization": f"Bearer {admin_key}"}
    for method, template, body in OPEN_TO_ADMINS:
        path = template.format(**world["names"])
        response = _call(client, method, path, body, admin, world["names"])
        # The job has ended: reads are 200, actions are refused by the lifecycle (409).
        assert response.status_code in {200, 409}, (path, response.text)
        if method == "GET" and not path.endswith(("/stream", "/logs", "/adapter_model.safetensors")):
            assert response.status_code == 200, (path, response.text)
    for method, template, body in SCOPED:
        if (method, template, body) not in OPEN_TO_ADMINS:
            path = template.format(**world["names"])
            assert _call(client, method, path, body, admin, world["names"]).status_code == 404, path
    assert client.get("/v1/fine_tuning/jobs", headers=admin).json()["data"] == []


def test_admin_action_on_another_organizations_job_is_recorded_as_admin(
    client, tenant_key, make_job, admin_key
) -> None:
    owner = tenant_key()
    job = make_job(owner.headers)
    admin = {"Authorization": f"Bearer {admin_key}"}
    cancelled = client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=admin)
    assert cancelled.status_code == 200, cancelled.text
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=owner.headers).json()["status"] == "cancelled"
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=owner.headers).json()["data"]
    assert events[0]["message"] == "Job cancelled by an administrator."
    assert events[0]["data"]["actor"] == "admin"


def test_admin_routes_need_admin(client, tenant_key, admin_key) -> None:
    tenant = tenant_key()
    names = {**FAKE_NAMES, "tenant_id": tenant.tenant_id}
    for method, template, body in ADMIN:
        path = template.format(**names)
        response = _call(client, method, path, body, tenant.headers)
        assert response.status_code == 403, path
        assert response.json()["error"]["code"] == "permission_denied"
        admin = _call(client, method, path, body, {"Authorization": f"Bearer {admin_key}"})
        assert admin.status_code in {200, 404} or (
            admin.status_code == 400 and admin.json()["error"]["param"] == "source"), (path, admin.text)


def test_report_route_uses_job_tokens(client, world, tenant_key, make_job, db_session) -> None:
    job_id = world["names"]["job_id"]
    path = f"/internal/v1/jobs/{job_id}/reports"
    body = {"seq": 99, "items": []}
    for headers in ({}, world["a"].headers, {"Authorization": "Bearer tfjob_wrong"}):
        response = client.post(path, json=body, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_job_token"
    other = db_session.get_one(Job, make_job(world["b"].headers)["id"])
    other_token = issue_job_token(db_session, other)
    db_session.commit()
    response = client.post(path, json=body, headers={"Authorization": f"Bearer {other_token}"})
    assert response.status_code == 404
