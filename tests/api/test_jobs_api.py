"""/v1/fine_tuning/jobs: create (auto resolution, extensions), list, actions, events, bad input."""

from __future__ import annotations

import hashlib

import pytest

from tests.api.conftest import BAD_LINES, start_running

JOBS = "/v1/fine_tuning/jobs"


def test_create_resolves_auto_and_keeps_extensions(client, tenant_key, make_job, inline_queue) -> None:
    headers = tenant_key().headers
    job = make_job(
        headers,
        hyperparameters={"n_epochs": 2},
        suffix="demo-1", seed=7, metadata={"team": "nlp"},
        adapter={"method": "qlora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        # The embedded local pool has one slot: two GPUs wait for a pool that is being added.
        trainer="fsdp_qlora", placement={"gpus": 2, "queue_if_unfit": True}, priority="high", max_seq_len=256,
        packing=True,
    )
    assert job["object"] == "fine_tuning.job" and job["id"].startswith("ftjob-")
    assert job["status"] == "queued"
    hp = job["hyperparameters"]
    # 12 examples: batch auto -> 1, n_epochs given -> 2, 12 steps/epoch -> 24 steps.
    assert (hp["n_epochs"], hp["batch_size"], hp["learning_rate_multiplier"]) == (2, 1, 1.0)
    assert hp["learning_rate"] == pytest.approx(2e-4) and job["total_steps"] == 24
    assert job["method"]["type"] == "supervised"
    assert job["adapter"] == {"method": "qlora", "r": 4, "alpha": 8.0, "dropout": 0.0,
                              "target_modules": ["q_proj", "v_proj"], "quantization": "nf4",
                              "double_quant": False}
    assert (job["trainer"], job["priority"], job["max_seq_len"], job["packing"]) == (
        "fsdp_qlora", 75, 256, True)
    assert job["placement"] == {"gpus": 2, "queue_if_unfit": True} and job["seed"] == 7
    assert job["user_provided_suffix"] == "demo-1" and job["metadata"] == {"team": "nlp"}
    assert "tunefleet.schedule" in inline_queue.names()


def test_method_hyperparameters(client, tenant_key, make_job) -> None:
    job = make_job(tenant_key().headers, method={
        "type": "supervised",
        "supervised": {"hyperparameters": {"batch_size": 4, "learning_rate_multiplier": 0.5}}})
    hp = job["hyperparameters"]
    assert hp["batch_size"] == 4 and hp["learning_rate"] == pytest.approx(1e-4)
    assert hp["n_epochs"] == 9  # 12 examples: ceil(100 / 12)
    assert job["method"]["supervised"]["hyperparameters"]["batch_size"] == 4


def test_still_validating_file_waits_then_queues(client, tenant_key, upload, inline_queue) -> None:
    headers = tenant_key().headers
    inline_queue.run_validation = False
    file_id = upload(headers).json()["id"]
    job = client.post(JOBS, headers=headers,
                      json={"model": "tunefleet-tiny-llama", "training_file": file_id}).json()
    assert job["status"] == "validating_files"
    assert job["hyperparameters"]["n_epochs"] == "auto"
    assert inline_queue.validate(file_id) == [job["id"]]
    job = client.get(f"{JOBS}/{job['id']}", headers=headers).json()
    assert job["status"] == "queued" and job["hyperparameters"]["n_epochs"] == 9


def test_file_failing_validation_fails_waiting_job(client, tenant_key, upload, inline_queue) -> None:
    headers = tenant_key().headers
    inline_queue.run_validation = False
    file_id = upload(headers, BAD_LINES).json()["id"]
    job = client.post(JOBS, headers=headers,
                      json={"model": "tunefleet-tiny-llama", "training_file": file_id}).json()
    inline_queue.validate(file_id)
    job = client.get(f"{JOBS}/{job['id']}", headers=headers).json()
    assert job["status"] == "failed"
    assert job["error"]["code"] == "invalid_file" and job["error"]["param"] == "training_file"
    assert "line 2" in job["error"]["message"]


def _post(client, headers, **body):
    return client.post(JOBS, headers=headers, json=body)


def test_bad_files(client, tenant_key, upload, processed_file) -> None:
    me, other = tenant_key().headers, tenant_key().headers
    bad = upload(me, BAD_LINES).json()["id"]
    response = _post(client, me, model="tunefleet-tiny-llama", training_file=bad)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "invalid_file"
    assert error["param"] == "training_file" and "line 2: invalid_json" in error["message"]
    assert error["details"]["errors"][0]["line"] == 2

    foreign = processed_file(other)
    for file_id in (foreign, "file-doesnotexist"):
        response = _post(client, me, model="tunefleet-tiny-llama", training_file=file_id)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_file"
        assert response.json()["error"]["param"] == "training_file"
    good = processed_file(me)
    response = _post(client, me, model="tunefleet-tiny-llama", training_file=good,
                     validation_file=foreign)
    assert response.status_code == 400 and response.json()["error"]["param"] == "validation_file"


@pytest.mark.parametrize(
    ("patch", "param", "code"),
    [
        ({"model": "gpt-17"}, "model", "invalid_model"),
        ({"model": 3}, "model", "invalid_request"),
        ({"hyperparameters": {"n_epochs": "three"}}, "hyperparameters.n_epochs", "invalid_request"),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs", "invalid_request"),
        ({"hyperparameters": {"batch_size": True}}, "hyperparameters.batch_size", "invalid_request"),
        ({"hyperparameters": {"epochs": 3}}, "hyperparameters.epochs", "invalid_request"),
        ({"method": {"type": "dpo"}}, "training_file", "file_method_mismatch"),  # a chat file
        ({"method": {"type": "reinforcement"}}, "method", "invalid_request"),  # no grader
        ({"method": {"type": "distillation"}}, "method.type", "invalid_request"),
        ({"adapter": {"method": "lora", "quantization": "nf4"}}, "adapter", "invalid_request"),
        ({"adapter": {"r": -1}}, "adapter.r", "invalid_request"),
        ({"adapter": {"target_modules": ["lm_head"]}}, "adapter.target_modules[0]",
         "invalid_request"),
        ({"trainer": "tensorflow"}, "trainer", "invalid_request"),
        ({"trainer": "jax", "adapter": {"method": "qlora", "quantization": "hqq4"}}, "trainer",
         "invalid_request"),
        ({"trainer": "jax", "adapter": {"method": "qlora", "double_quant": True}}, "trainer",
         "invalid_request"),
        ({"adapter": {"method": "qlora", "quantization": "hqq4", "double_quant": True}},
         "adapter", "invalid_request"),
        ({"adapter": {"method": "qlora", "double_quant": "yes"}}, "adapter.double_quant",
         "invalid_request"),
        ({"priority": "urgent"}, "priority", "invalid_request"),
        ({"priority": 101}, "priority", "invalid_request"),
        ({"placement": {"gpus": 0}}, "placement.gpus", "invalid_request"),
        ({"max_seq_len": 100000}, "max_seq_len", "invalid_request"),
        ({"packing": "yes"}, "packing", "invalid_request"),
        ({"suffix": "x" * 65}, "suffix", "invalid_request"),
        ({"suffix": ""}, "suffix", "invalid_request"),
        ({"suffix": "new\nline"}, "suffix", "invalid_request"),
        ({"metadata": {"k": 5}}, "metadata.k", "invalid_request"),
        ({"integrations": [{"type": "wandb"}]}, "integrations[0]", "invalid_request"),
        ({"unknown_field": 1}, "unknown_field", "invalid_request"),
        ({"training_file": None}, "training_file", "invalid_request"),
    ],
)
def test_bad_bodies_name_the_field(client, tenant_key, processed_file, patch, param, code) -> None:
    headers = tenant_key().headers
    body = {"model": "tunefleet-tiny-llama", "training_file": processed_file(headers), **patch}
    response = client.post(JOBS, headers=headers, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize(
    ("content", "code"),
    [(b"{not json", "invalid_json"), (b"[1, 2]", "invalid_request"), (b"", "invalid_request"),
     (b'"a string"', "invalid_request"), (b"\xff\xfe", "invalid_json")],
)
def test_malformed_bodies(client, tenant_key, content, code) -> None:
    headers = {**tenant_key().headers, "Content-Type": "application/json"}
    response = client.post(JOBS, headers=headers, content=content)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == code


def test_idempotency_key(client, tenant_key, processed_file) -> None:
    headers = tenant_key().headers
    file_id = processed_file(headers)
    body = {"model": "tunefleet-tiny-llama", "training_file": file_id, "seed": 1}
    first = client.post(JOBS, headers={**headers, "Idempotency-Key": "k1"}, json=body)
    again = client.post(JOBS, headers={**headers, "Idempotency-Key": "k1"},
                        json=dict(reversed(list(body.items()))))
    assert first.status_code == again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    conflict = client.post(JOBS, headers={**headers, "Idempotency-Key": "k1"},
                           json={**body, "seed": 2})
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "idempotency_conflict"
    other = client.post(JOBS, headers={**headers, "Idempotency-Key": "k2"}, json=body)
    assert other.json()["id"] != first.json()["id"]
    assert len(client.get(JOBS, headers=headers).json()["data"]) == 2


def test_list_cursor_and_metadata_filter(client, tenant_key, processed_file) -> None:
    headers = tenant_key().headers
    file_id = processed_file(headers)
    ids = []
    for i in range(3):
        body = {"model": "tunefleet-tiny-llama", "training_file": file_id,
                "metadata": {"run": str(i), "team": "a" if i < 2 else "b"}}
        ids.append(client.post(JOBS, headers=headers, json=body).json()["id"])
    page = client.get(f"{JOBS}?limit=2", headers=headers).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [j["id"] for j in page["data"]] == [ids[2], ids[1]]
    rest = client.get(f"{JOBS}?limit=2&after={ids[1]}", headers=headers).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]] and rest["has_more"] is False
    team_a = client.get(JOBS, headers=headers, params={"metadata[team]": "a"}).json()
    assert sorted(j["id"] for j in team_a["data"]) == sorted(ids[:2])
    both = client.get(JOBS, headers=headers, params={"metadata[team]": "a", "metadata[run]": "1"})
    assert [j["id"] for j in both.json()["data"]] == [ids[1]]
    for query in ("after=ftjob-unknown", "limit=101", "metadata=x"):
        bad = client.get(f"{JOBS}?{query}", headers=headers)
        assert bad.status_code == 400, query
    assert client.get(f"{JOBS}?after=ftjob-unknown", headers=headers).json()["error"]["code"] == (
        "invalid_cursor")


def test_cancel_pause_resume_and_illegal_transitions(client, tenant_key, make_job) -> None:
    headers = tenant_key().headers
    job = make_job(headers)
    paused = client.post(f"{JOBS}/{job['id']}/pause", headers=headers).json()
    assert paused["status"] == "paused"
    again = client.post(f"{JOBS}/{job['id']}/pause", headers=headers)
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "invalid_state_transition"
    resumed = client.post(f"{JOBS}/{job['id']}/resume", headers=headers).json()
    assert resumed["status"] == "queued"
    cancelled = client.post(f"{JOBS}/{job['id']}/cancel", headers=headers).json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"] is not None
    for action in ("cancel", "pause", "resume"):
        response = client.post(f"{JOBS}/{job['id']}/{action}", headers=headers)
        assert response.status_code == 409, action
        assert "cancelled" in response.json()["error"]["message"]
    events = client.get(f"{JOBS}/{job['id']}/events?limit=100", headers=headers).json()["data"]
    statuses = [e["data"]["to"] for e in events if "to" in (e["data"] or {})]
    assert statuses == ["cancelled", "queued", "paused", "queued"]  # newest first


def test_events_cursor(client, tenant_key, make_job) -> None:
    headers = tenant_key().headers
    job = make_job(headers)
    client.post(f"{JOBS}/{job['id']}/pause", headers=headers)
    client.post(f"{JOBS}/{job['id']}/resume", headers=headers)
    everything = client.get(f"{JOBS}/{job['id']}/events?limit=100", headers=headers).json()["data"]
    assert len(everything) == 4
    first = client.get(f"{JOBS}/{job['id']}/events?limit=2", headers=headers).json()
    assert first["has_more"] is True
    rest = client.get(f"{JOBS}/{job['id']}/events?limit=2&after={first['data'][-1]['id']}",
                      headers=headers).json()
    assert [e["id"] for e in first["data"] + rest["data"]] == [e["id"] for e in everything]
    bad = client.get(f"{JOBS}/{job['id']}/events?after=ftevent-x", headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_cursor"


def test_unknown_routes_and_methods(client, tenant_key) -> None:
    headers = tenant_key().headers
    response = client.get("/v1/nothing", headers=headers)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    response = client.put(JOBS, headers=headers)
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_values_the_database_cannot_store_are_400(client, tenant_key, processed_file) -> None:
    headers = tenant_key().headers
    file_id = processed_file(headers)
    cases = [
        client.get(f"{JOBS}/ftjob-%00x", headers=headers),
        client.get(f"{JOBS}?after=ftjob-%00", headers=headers),
        client.get(JOBS, headers=headers, params={"metadata[a\x00]": "b"}),
        client.post(JOBS, headers=headers, json={"model": "tunefleet-tiny-llama",
                                                 "training_file": "file-\x00"}),
        client.post(JOBS, headers=headers, json={"model": "tunefleet-tiny-llama",
                                                 "training_file": file_id, "seed": 2**40}),
    ]
    # Never a 5xx; SQLite stores a NUL where PostgreSQL refuses it, so an empty page is fine too.
    for response in cases[:2] + cases[3:]:
        assert response.status_code in (400, 404), response.text
        assert response.json()["error"]["code"] in {"invalid_request", "not_found", "invalid_file",
                                                    "invalid_cursor"}
    assert cases[2].status_code == 400 or cases[2].json()["data"] == []
    # A raw multipart body (httpx would percent-encode the control characters).
    body = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="../../x\x00\x07.jsonl"'
            b'\r\n\r\n{"prompt": "a", "completion": "b"}\n\r\n--b--\r\n')
    upload = client.post("/v1/files", content=body, headers={
        **headers, "Content-Type": "multipart/form-data; boundary=b"})
    assert upload.status_code == 200 and upload.json()["filename"] == "x.jsonl", upload.text


def test_concurrent_same_idempotency_key_makes_one_job(app, live_server, tenant_key,
                                                        processed_file) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    headers = tenant_key().headers
    body = {"model": "tunefleet-tiny-llama", "training_file": processed_file(headers)}
    base = live_server(app)

    def create(_: int) -> httpx.Response:
        return httpx.post(f"{base}{JOBS}", json=body, timeout=30,
                          headers={**headers, "Idempotency-Key": "race"})

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(create, range(4)))
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert len({r.json()["id"] for r in responses}) == 1
    assert len(httpx.get(f"{base}{JOBS}", headers=headers).json()["data"]) == 1


@pytest.mark.parametrize(
    ("suffix", "in_name"),
    [("demo-1", "demo-1"), ("My model v1.2:beta/x", "My-model-v1.2-beta-x"), ("é" * 64, "-" * 64)],
)
def test_suffix_is_openais_and_names_the_model(client, tenant_key, make_job, db_session, settings,
                                               suffix, in_name) -> None:
    """OpenAI's rule: any 1-64 characters, echoed as given; the model name is
    ``ft:<base>:<org>:<suffix>:<job id>`` with the suffix kept to name-safe characters."""
    headers = tenant_key().headers
    job = make_job(headers, suffix=suffix)
    assert job["user_provided_suffix"] == suffix
    _row, token = start_running(db_session, job["id"])
    out = settings.data_path / "artifacts" / job["id"] / "output"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_model.safetensors").write_bytes(b"w")
    report = client.post(
        f"/internal/v1/jobs/{job['id']}/reports", headers={"Authorization": f"Bearer {token}"},
        json={"seq": 0, "items": [{"type": "artifacts", "location": str(out), "files": [
            {"name": "adapter/adapter_model.safetensors", "bytes": 1,
             "sha256": hashlib.sha256(b"w").hexdigest()}]}]})
    assert report.status_code == 200, report.text
    named = client.get(f"{JOBS}/{job['id']}", headers=headers).json()["fine_tuned_model"]
    assert named == f"ft:tunefleet-tiny-llama:{job['organization_id']}:{in_name}:{job['id']}"
