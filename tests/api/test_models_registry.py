"""Base models admins register through ``POST /v1/models``: checked at registration, listed
for every tenant, trained on; Hub ids fetched by the worker from a fake Hub (HF_ENDPOINT)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from control.ids import new_id
from tests.api.test_artifact_store import s3_endpoint  # noqa: F401 (the moto_server fixture)
from tests.hub.fake_hub import FakeHub


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.model_files import save_tiny_family

    return save_tiny_family(tmp_path_factory.mktemp("models") / "qwen3", "qwen3")


@pytest.fixture
def settings(settings, tmp_path_factory: pytest.TempPathFactory):
    """Hub repos allowed, and checkpoints registered from anywhere under the test's temporary
    directories (the copies and broken variants below are made there)."""
    return settings.model_copy(update={"hub_allowed_repos": "tiny-org/*, other/exact",
                                       "model_roots": str(tmp_path_factory.getbasetemp())})


def _error(response) -> tuple[int, str, str | None]:
    error = response.json()["error"]
    return response.status_code, error["code"], error["param"]


def test_a_registered_checkpoint_is_listed_for_every_tenant_and_trains(
        client, admin_key, tenant_key, make_job, tiny_qwen3: Path) -> None:
    admin = {"Authorization": f"Bearer {admin_key}"}
    tenant = tenant_key()
    model_id = f"acme/qwen3-{new_id('m')}"
    body = {"id": model_id, "source": str(tiny_qwen3)}
    assert _error(client.post("/v1/models", headers=tenant.headers, json=body))[:2] == (403, "permission_denied")

    created = client.post("/v1/models", headers=admin, json=body)
    assert created.status_code == 200, created.text
    model = created.json()
    assert (model["id"], model["kind"], model["status"], model["architecture"], model["max_seq_len"]) == (
        model_id, "base", "ready", "qwen3", 512)

    listed = {m["id"]: m for m in client.get("/v1/models", headers=tenant.headers).json()["data"]}
    assert listed[model_id]["status"] == "ready" and "tunefleet-tiny-llama" in listed
    job = make_job(tenant.headers, model=model_id)
    assert job["model"] == model_id and job["status"] in ("validating_files", "queued")

    assert _error(client.post("/v1/models", headers=admin, json=body)) == (409, "model_exists", "id")
    assert _error(client.post("/v1/models", headers=admin,
                              json={"id": "tunefleet-tiny-llama", "source": str(tiny_qwen3)}))[:2] == (
        409, "model_exists")
    assert _error(client.post("/v1/models", headers=admin, json={"id": "x", "source": "models/a/b"})
                  ) == (400, "invalid_model_source", "source")


def test_tenants_are_not_told_where_a_registered_model_lives(
        client, admin_key, tenant_key, tiny_qwen3: Path) -> None:
    admin = {"Authorization": f"Bearer {admin_key}"}
    tenant = tenant_key()
    model_id = f"acme/qwen3-{new_id('m')}"
    assert client.post("/v1/models", headers=admin, json={"id": model_id, "source": str(tiny_qwen3)}
                       ).status_code == 200
    listed = {m["id"]: m for m in client.get("/v1/models", headers=tenant.headers).json()["data"]}
    retrieved = client.get(f"/v1/models/{model_id}", headers=tenant.headers).json()
    assert listed[model_id].get("source") is None and retrieved.get("source") is None
    assert str(tiny_qwen3) not in client.get("/v1/models", headers=tenant.headers).text
    assert client.get(f"/v1/models/{model_id}", headers=admin).json()["source"] == str(tiny_qwen3)
    admin_list = {m["id"]: m for m in client.get("/v1/models", headers=admin).json()["data"]}
    assert admin_list[model_id]["source"] == str(tiny_qwen3)


def test_only_directories_under_the_model_roots_are_registered(
        client, admin_key, settings, tiny_qwen3: Path, tmp_path: Path) -> None:
    admin = {"Authorization": f"Bearer {admin_key}"}
    root = tmp_path / "models"
    inside = root / "qwen3"
    shutil.copytree(tiny_qwen3, inside)
    (root / "escape").symlink_to(tiny_qwen3, target_is_directory=True)
    client.app.state.settings = settings.model_copy(update={"model_roots": f"{tmp_path / 'other'}, {root}"})

    def register(source: str) -> tuple[int, str, str | None]:
        response = client.post("/v1/models", headers=admin, json={"id": f"m-{new_id('m')}", "source": source})
        return (200, "", None) if response.status_code == 200 else _error(response)

    refused = (400, "model_source_not_allowed", "source")
    assert register(str(tiny_qwen3)) == refused  # outside every root
    assert register(str(root / "escape")) == refused  # a link inside a root to a directory outside
    assert register(f"{root}/../../{tiny_qwen3.relative_to(tiny_qwen3.parents[1])}") == refused
    assert register(str(root) + "-sibling") == refused  # a name that only starts like a root
    assert register(str(inside)) == (200, "", None)


def _index(model_dir: Path, weight_map: dict[str, str]) -> None:
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_broken_checkpoint_is_a_400_at_registration(client, admin_key, tiny_qwen3: Path,
                                                      tmp_path: Path) -> None:
    from safetensors import safe_open

    admin = {"Authorization": f"Bearer {admin_key}"}
    with safe_open(tiny_qwen3 / "model.safetensors", "np") as f:
        tensors = list(f.keys())

    def broken(name: str, breakage) -> tuple[int, str, str | None]:
        copy = tmp_path / name
        shutil.copytree(tiny_qwen3, copy)
        breakage(copy)
        return _error(client.post("/v1/models", headers=admin,
                                  json={"id": f"broken-{name}-{new_id('m')}", "source": str(copy)}))

    def config(**change):
        def apply(d: Path) -> None:
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, **change}))
        return apply

    cases = {
        "no-config": (lambda d: (d / "config.json").unlink(), "model_config_unreadable"),
        "bad-config": (lambda d: (d / "config.json").write_text("{not json"), "model_config_unreadable"),
        "gemma": (config(model_type="gemma2"), "unsupported_architecture"),
        "no-tokenizer": (lambda d: (d / "tokenizer.json").unlink(), "tokenizer_missing"),
        "no-weights": (lambda d: (d / "model.safetensors").unlink(), "weights_missing"),
        "index-missing-shard": (lambda d: _index(d, {t: "model-00002-of-00002.safetensors" for t in tensors}),
                                "inconsistent_weights"),
        "index-extra-tensor": (lambda d: _index(d, {**{t: "model.safetensors" for t in tensors},
                                                    "lm_head.bias": "model.safetensors"}), "inconsistent_weights"),
        "index-lacks-tensor": (lambda d: _index(d, {t: "model.safetensors" for t in tensors[1:]}),
                               "inconsistent_weights"),
        "truncated-shard": (lambda d: (d / "model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{"),
                            "inconsistent_weights"),
    }
    got = {name: broken(name, breakage) for name, (breakage, _) in cases.items()}
    assert got == {name: (400, code, "source") for name, (_, code) in cases.items()}
    # the same checkpoint with a consistent index registers
    indexed = tmp_path / "indexed"
    shutil.copytree(tiny_qwen3, indexed)
    _index(indexed, {t: "model.safetensors" for t in tensors})
    ok = client.post("/v1/models", headers=admin, json={"id": f"indexed-{new_id('m')}", "source": str(indexed)})
    assert ok.status_code == 200 and ok.json()["status"] == "ready", ok.text


def test_admins_delete_registered_base_models_only(client, admin_key, tenant_key, make_job,
                                                   tiny_qwen3: Path) -> None:
    admin = {"Authorization": f"Bearer {admin_key}"}
    tenant = tenant_key()
    model_id = f"acme/deletable-{new_id('m')}"
    assert client.post("/v1/models", headers=admin, json={"id": model_id, "source": str(tiny_qwen3)}).status_code == 200
    assert _error(client.delete(f"/v1/models/{model_id}", headers=tenant.headers))[:2] == (
        403, "base_model_not_deletable")
    assert _error(client.delete("/v1/models/tunefleet-tiny-llama", headers=admin)) == (
        409, "model_declared_in_file", "model")

    job = make_job(tenant.headers, model=model_id)
    in_use = client.delete(f"/v1/models/{model_id}", headers=admin)
    assert _error(in_use)[:2] == (409, "model_in_use") and job["id"] in in_use.json()["error"]["message"]
    assert client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=tenant.headers).status_code == 200

    deleted = client.delete(f"/v1/models/{model_id}", headers=admin)
    assert deleted.status_code == 200 and deleted.json() == {"id": model_id, "object": "model", "deleted": True}
    assert model_id not in {m["id"] for m in client.get("/v1/models", headers=tenant.headers).json()["data"]}
    assert client.get(f"/v1/models/{model_id}", headers=tenant.headers).status_code == 404
    refused = client.post("/v1/fine_tuning/jobs", headers=tenant.headers,
                          json={"model": model_id, "training_file": job["training_file"]})
    assert _error(refused) == (400, "invalid_model", "model")
    assert tiny_qwen3.joinpath("config.json").is_file()  # the operator's files stay


# ---- Hub ids ---------------------------------------------------------------------------

@pytest.fixture
def fake_hub(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch):
    hub = FakeHub()
    endpoint, server = hub.serve()
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield hub
    server.shutdown()


def _fetch(settings, model_id: str) -> str:
    """The worker's task body (tunefleet.fetch_hub_model)."""
    from control.db.session import session_scope
    from control.models.registry import fetch_registered_model

    with session_scope(settings.resolved_database_url) as session:
        return fetch_registered_model(session, settings, model_id)


def test_a_hub_model_is_fetched_once_checked_and_trained_on(
        client, settings, admin_key, tenant_key, inline_queue, make_job, fake_hub: FakeHub,
        tiny_qwen3: Path) -> None:
    admin = {"Authorization": f"Bearer {admin_key}"}
    repo_id = f"tiny-org/qwen3-{new_id('r')}"
    repo = fake_hub.add_repo(repo_id, tiny_qwen3)

    created = client.post("/v1/models", headers=admin, json={"source": f"{repo_id}@main"})
    assert created.status_code == 200, created.text
    assert (created.json()["id"], created.json()["status"]) == (repo_id, "fetching")
    assert ("tunefleet.fetch_hub_model", (repo_id,), {}) in inline_queue.sent
    tenant = tenant_key()
    refused = client.post("/v1/fine_tuning/jobs", headers=tenant.headers, json={"model": repo_id, "training_file": "x"})
    assert _error(refused)[:2] == (400, "invalid_model")  # not trainable before it is fetched
    assert "POST /v1/models" in refused.json()["error"]["message"]

    assert _fetch(settings, repo_id) == "ready"
    model = client.get(f"/v1/models/{repo_id}", headers=tenant.headers).json()
    assert (model["status"], model["revision"], model["architecture"]) == ("ready", repo.sha, "qwen3")
    snapshot = Path(settings.resolved_artifact_url) / "models" / "hub" / repo_id / repo.sha
    assert (snapshot / "model.safetensors").read_bytes() == (tiny_qwen3 / "model.safetensors").read_bytes()
    job = make_job(tenant.headers, model=repo_id)
    assert job["model"] == repo_id
    spec = _spec(settings, job["id"])
    assert (spec.model.path, spec.model.revision, spec.model.architecture) == (str(snapshot), repo.sha, "qwen3")
    # the adapter a trainer exports for it names the base and its commit
    from trainers.common.outputs import finish_adapter
    from trainers.common.peft_export import ADAPTER_CONFIG, MODEL_CARD

    adapter = settings.data_path / "adapter-out"
    adapter.mkdir()
    (adapter / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA"}))
    finish_adapter(adapter, spec)
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == (repo_id, repo.sha)
    assert repo.sha in (adapter / MODEL_CARD).read_text()

    # a second registration of the same commit reuses the download
    downloads = sum(1 for method, path in fake_hub.requests if method == "GET" and "/resolve/" in path)
    pinned = f"pinned-{new_id('m')}"
    assert client.post("/v1/models", headers=admin,
                       json={"id": pinned, "source": f"{repo_id}@{repo.sha}"}).status_code == 200
    assert _fetch(settings, pinned) == "ready"
    assert sum(1 for method, path in fake_hub.requests if method == "GET" and "/resolve/" in path) == downloads


def _spec(settings, job_id: str):
    """The trainer spec the scheduler would build for the job (one CPU process)."""
    from control.db.models import Job
    from control.db.session import session_scope
    from worker.spec_builder import build_spec

    with session_scope(settings.resolved_database_url) as session:
        return build_spec(session, session.get_one(Job, job_id), settings, pool_accelerator="cpu",
                          pool_families=("fsdp_qlora",), gpus=1, token="t")


def test_hub_ids_the_operator_does_not_allow_are_refused(client, admin_key) -> None:
    admin = {"Authorization": f"Bearer {admin_key}"}
    assert _error(client.post("/v1/models", headers=admin, json={"source": "other/model"})) == (
        400, "hub_repo_not_allowed", "source")


@pytest.mark.parametrize("backend", ["sqlite"])
def test_hub_off_by_default(backend, tmp_path: Path, sqlite_template: Path, tenant_key) -> None:
    from fastapi.testclient import TestClient

    from api.main import create_app
    from tests.conftest import InlineQueue, make_settings

    data = tmp_path / "off"
    data.mkdir()
    shutil.copyfile(sqlite_template, data / "tunefleet.db")
    off = make_settings(data)
    from control.auth import create_api_key, create_tenant
    from control.db.session import session_scope

    with session_scope(off.resolved_database_url) as session:
        _, key = create_api_key(session, create_tenant(session, "root", is_admin=True), is_admin=True)
    with TestClient(create_app(off, queue=InlineQueue(off))) as client:
        refused = client.post("/v1/models", headers={"Authorization": f"Bearer {key}"},
                              json={"source": "Qwen/Qwen3-8B"})
    assert _error(refused) == (400, "hub_disabled", "source")


def test_gated_missing_and_unreachable_hub_models_fail_with_their_codes(
        client, settings, admin_key, fake_hub: FakeHub, tiny_qwen3: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import free_port

    admin = {"Authorization": f"Bearer {admin_key}"}
    gated = f"tiny-org/gated-{new_id('r')}"
    fake_hub.add_repo(gated, tiny_qwen3, gated=True)
    fake_hub.tokens.add("hf_granted")
    cases = {gated: "model_access_denied", f"tiny-org/missing-{new_id('r')}": "model_not_found"}
    for repo_id, code in cases.items():
        assert client.post("/v1/models", headers=admin, json={"source": repo_id}).status_code == 200
        assert _fetch(settings, repo_id) == "failed"
        model = client.get(f"/v1/models/{repo_id}", headers=admin).json()
        assert (model["status"], model["error"]["code"]) == ("failed", code)

    endpoint = os.environ["HF_ENDPOINT"]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    offline = f"tiny-org/offline-{new_id('r')}"
    assert client.post("/v1/models", headers=admin, json={"source": offline}).status_code == 200
    assert _fetch(settings, offline) == "failed"
    assert client.get(f"/v1/models/{offline}", headers=admin).json()["error"]["code"] == "hub_unreachable"

    # with a granted token the gated repo registers (a failed registration is deleted first)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    assert client.delete(f"/v1/models/{gated}", headers=admin).status_code == 200
    assert client.post("/v1/models", headers=admin, json={"source": gated}).status_code == 200
    assert _fetch(settings, gated) == "ready"


@pytest.mark.parametrize("backend", ["sqlite"])
def test_checkpoints_and_hub_models_in_a_bucket(backend, settings, fake_hub: FakeHub, tiny_qwen3: Path,
                                                request: pytest.FixtureRequest) -> None:
    """Kubernetes mode: an s3:// source is checked through S3, a Hub model lands in the bucket."""
    from control.artifacts import artifact_store, store_for
    from control.errors import APIError
    from control.models.checkpoint_checks import check_checkpoint
    from control.models.hub import HubRef, fetch_snapshot

    endpoint = request.getfixturevalue("s3_endpoint")
    in_s3 = settings.model_copy(update={"artifact_url": f"s3://tf-artifacts/{new_id('reg')}",
                                        "s3_endpoint_url": endpoint})
    bucket = artifact_store(in_s3)
    for path in tiny_qwen3.iterdir():
        bucket.put_file(f"ckpt/{path.name}", path)
    checkpoint = store_for(bucket.location("ckpt"), s3_endpoint_url=endpoint)
    assert check_checkpoint(checkpoint).architecture == "qwen3"
    checkpoint.delete("tokenizer.json")
    with pytest.raises(APIError) as caught:
        check_checkpoint(checkpoint)
    assert caught.value.code == "tokenizer_missing"

    repo_id = f"tiny-org/s3-{new_id('r')}"
    repo = fake_hub.add_repo(repo_id, tiny_qwen3)
    snapshot = fetch_snapshot(HubRef(repo_id, None), in_s3, bucket)
    assert snapshot.location == bucket.location(f"models/hub/{repo_id}/{repo.sha}")
    stored = store_for(snapshot.location, s3_endpoint_url=endpoint)
    assert stored.read_bytes("model.safetensors") == (tiny_qwen3 / "model.safetensors").read_bytes()
    assert check_checkpoint(stored).max_seq_len == 512
    assert not any((in_s3.tmp_dir / "hub").rglob("*.safetensors"))  # the scratch copy is gone
