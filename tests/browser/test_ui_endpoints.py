"""The dashboard's server side without a browser: login form, cookie auth on the JSON
API, and the dashboard-only endpoints (``/ui/api/...``), on the app from ``create_app``.

Uses the suite's fixtures (tests/conftest.py): ``client`` (TestClient, files validated
inline), ``tenant_key``, ``db_session``.
"""

from __future__ import annotations

import json
import re

import pytest

from control.db.models import ApiKey
from tests.api.conftest import start_running

WORDS = ["able", "acid", "aged", "area", "army", "baby"]
TRAIN = "".join(
    json.dumps({"messages": [{"role": "user", "content": f"reverse {w}"},
                             {"role": "assistant", "content": w[::-1]}]}) + "\n"
    for w in WORDS * 8  # 48 examples
).encode()


def _login(client, key: str, next_path: str = "/ui/") -> object:
    client.cookies.clear()
    form = client.get("/ui/login")
    assert form.status_code == 200
    token = re.search(r'name="csrf_token" value="([^"]+)"', form.text).group(1)
    return client.post("/ui/login", data={"api_key": key, "csrf_token": token, "next": next_path},
                       follow_redirects=False)


def _csrf(client) -> str:
    page = client.get("/ui/")
    return re.search(r'<meta name="csrf-token" content="([^"]+)"', page.text).group(1)


def _job(client, headers: dict[str, str], suffix: str) -> str:
    file = client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"},
                       files={"file": ("t.jsonl", TRAIN, "application/jsonl")}).json()
    assert client.get(f"/v1/files/{file['id']}", headers=headers).json()["status"] == "processed"
    job = client.post("/v1/fine_tuning/jobs", headers=headers, json={
        "model": "tunefleet-tiny-llama", "training_file": file["id"], "suffix": suffix})
    assert job.status_code == 200, job.text
    return job.json()["id"]


def test_login_sets_a_session_and_redirects_only_inside_the_dashboard(client, tenant_key) -> None:
    org = tenant_key("acme")
    answer = _login(client, org.key, next_path="/ui/pools")
    assert answer.status_code == 303
    assert answer.headers["location"] == "/ui/pools"
    cookie = answer.headers["set-cookie"]
    assert "tf_session=" in cookie and "HttpOnly" in cookie and "samesite=strict" in cookie.lower()
    assert org.key not in cookie
    assert client.get("/ui/pools").status_code == 200
    # An off-site "next" is replaced by the dashboard's home (no open redirect).
    assert _login(client, org.key, next_path="//evil.example/x").headers["location"] == "/ui/"


def test_login_refuses_a_bad_key_and_a_forged_form(client, tenant_key) -> None:
    org = tenant_key("acme")
    bad = _login(client, "tf_AAAAAAAA_" + "B" * 32)
    assert bad.status_code == 401 and "not valid" in bad.text
    assert "tf_session" not in client.cookies
    client.cookies.clear()
    forged = client.post("/ui/login", data={"api_key": org.key, "csrf_token": "guess"},
                         follow_redirects=False)
    assert forged.status_code == 403
    assert "tf_session" not in client.cookies


def test_pages_without_a_session_redirect_to_login(client) -> None:
    answer = client.get("/ui/jobs/ftjob-abc?x=1", follow_redirects=False)
    assert answer.status_code == 303
    assert answer.headers["location"] == "/ui/login?next=/ui/jobs/ftjob-abc%3Fx%3D1"


def test_cookie_authenticates_the_json_api_with_csrf_for_unsafe_calls(client, tenant_key, db_session) -> None:
    org = tenant_key("acme")
    _login(client, org.key)
    assert client.get("/v1/files").status_code == 200
    upload = {"data": {"purpose": "fine-tune"}, "files": {"file": ("t.jsonl", TRAIN, "application/jsonl")}}
    refused = client.post("/v1/files", **upload)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "csrf_failed"
    token = _csrf(client)
    assert client.post("/v1/files", headers={"X-CSRF-Token": token}, **upload).status_code == 200
    # Revoking the key ends its dashboard sessions at once.
    key = db_session.query(ApiKey).filter(ApiKey.tenant_id == org.tenant_id).one()
    from control.auth import revoke_api_key

    revoke_api_key(db_session, key)
    db_session.commit()
    assert client.get("/v1/files").status_code == 401
    assert client.get("/ui/", follow_redirects=False).status_code == 303


def test_jobs_table_is_tenant_scoped_and_admins_see_every_tenant(client, tenant_key, db_session) -> None:
    acme, other = tenant_key("acme"), tenant_key("other")
    admin = tenant_key("ops", admin=True)
    acme_job = _job(client, acme.headers, "acme-run")
    other_job = _job(client, other.headers, "other-run")

    _login(client, acme.key)
    mine = client.get("/ui/api/jobs").json()
    assert [j["id"] for j in mine["data"]] == [acme_job]
    assert mine["data"][0]["tenant_name"] == "acme"
    # A tenant's "tenant" filter cannot widen its view.
    listed = client.get("/ui/api/jobs", params={"tenant": other.tenant_id}).json()["data"]
    assert [j["id"] for j in listed] == [acme_job]
    assert client.get(f"/ui/jobs/{other_job}").status_code == 404
    assert client.get(f"/ui/jobs/{acme_job}").status_code == 200

    _login(client, admin.key)
    every = {j["id"] for j in client.get("/ui/api/jobs").json()["data"]}
    assert {acme_job, other_job} <= every
    narrowed = client.get("/ui/api/jobs", params={"tenant": other.tenant_id}).json()["data"]
    assert [j["id"] for j in narrowed] == [other_job]
    assert narrowed[0]["tenant_name"] == "other"
    found = client.get("/ui/api/jobs", params={"q": "acme-r"}).json()["data"]
    assert [j["id"] for j in found] == [acme_job]
    # LIKE wildcards in the search are literal.
    assert client.get("/ui/api/jobs", params={"q": "%"}).json()["data"] == []
    status = client.get("/ui/api/jobs", params={"status": "succeeded"}).json()["data"]
    assert status == []
    assert client.get("/ui/api/jobs", params={"status": "nope"}).status_code == 400
    # Cursor pagination, newest first, like the public list.
    first = client.get("/ui/api/jobs", params={"limit": 1}).json()
    assert first["has_more"] is True and len(first["data"]) == 1
    second = client.get("/ui/api/jobs", params={"limit": 1, "after": first["last_id"]}).json()
    assert second["data"][0]["created_at"] <= first["data"][0]["created_at"]
    assert second["data"][0]["id"] != first["data"][0]["id"]
    tenants = {t["name"] for t in client.get("/ui/api/tenants").json()["data"]}
    assert {"acme", "other", "ops"} <= tenants


def test_jobs_table_carries_the_latest_metric(client, tenant_key, db_session) -> None:
    acme = tenant_key("acme")
    job_id = _job(client, acme.headers, "m")
    _row, token = start_running(db_session, job_id)  # trainers report while their job runs
    for seq, (step, loss) in enumerate([(1, 3.5), (3, 2.25), (2, 2.75)], start=1):
        answer = client.post(f"/internal/v1/jobs/{job_id}/reports",
                             headers={"Authorization": f"Bearer {token}"},
                             json={"seq": seq, "items": [{"type": "metric", "step": step,
                                                          "total_steps": 10, "train_loss": loss,
                                                          "tokens_per_s": 100.0 * step}]})
        assert answer.status_code == 200, answer.text
    _login(client, acme.key)
    row = client.get("/ui/api/jobs").json()["data"][0]
    assert row["latest_metric"]["step"] == 3
    assert row["latest_metric"]["train_loss"] == 2.25
    assert row["latest_metric"]["tokens_per_s"] == 300.0


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # 48 examples (control/jobs/hyperparameters.py): 3 epochs; batch = 2**round(log2(0.096)) -> 1;
        # 48 steps per epoch; learning rate 2e-4 x multiplier.
        ({}, {"n_epochs": 3, "batch_size": 1, "total_steps": 144, "learning_rate": 2e-4}),
        ({"n_epochs": "2", "batch_size": "4"}, {"n_epochs": 2, "batch_size": 4, "total_steps": 24}),
        ({"learning_rate_multiplier": "0.5", "max_steps": "10"}, {"total_steps": 10, "learning_rate": 1e-4}),
        # DPO: beta too (OpenAI's default 0.1 for "auto"); the other values by the same rule.
        ({"method": "dpo"}, {"beta": 0.1, "n_epochs": 3, "total_steps": 144}),
        ({"method": "dpo", "beta": "0.5", "batch_size": "4"}, {"beta": 0.5, "total_steps": 36}),
    ],
)
def test_resolved_auto_hyperparameters(client, tenant_key, params, expected) -> None:
    acme = tenant_key("acme")
    file = client.post("/v1/files", headers=acme.headers, data={"purpose": "fine-tune"},
                       files={"file": ("t.jsonl", TRAIN, "application/jsonl")}).json()
    _login(client, acme.key)
    answer = client.get("/ui/api/hyperparameters", params={"training_file": file["id"], **params})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["n_examples"] == 48
    for name, value in expected.items():
        assert body["hyperparameters"][name] == pytest.approx(value), name


def test_resolved_hyperparameters_refuse_bad_input_and_foreign_files(client, tenant_key) -> None:
    acme, other = tenant_key("acme"), tenant_key("other")
    file = client.post("/v1/files", headers=other.headers, data={"purpose": "fine-tune"},
                       files={"file": ("t.jsonl", TRAIN, "application/jsonl")}).json()
    assert client.get("/ui/api/hyperparameters", params={"training_file": file["id"]}).status_code == 401
    _login(client, acme.key)
    foreign = client.get("/ui/api/hyperparameters", params={"training_file": file["id"]})
    assert foreign.status_code == 404
    own = client.post("/v1/files", headers=acme.headers, data={"purpose": "fine-tune"},
                      files={"file": ("t.jsonl", TRAIN, "application/jsonl")}).json()
    bad = client.get("/ui/api/hyperparameters", params={"training_file": own["id"], "n_epochs": "many"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "n_epochs"
    for beta in ("0", "2.5", "strong"):
        bad = client.get("/ui/api/hyperparameters", params={"training_file": own["id"], "method": "dpo", "beta": beta})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "beta", (beta, bad.text)
