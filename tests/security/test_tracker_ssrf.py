"""A job's MLflow ``tracking_uri`` cannot make the trainer call into the service's network.

The probe: a tenant set ``tracking_uri`` to ``http://127.0.0.1:PORT/...``; the trainer
fetched it and the answer's body landed in the tenant's job events. ``sqlite:`` and
``file:`` URIs wrote on the trainer's filesystem.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from tests.security.listener import Listener
from trainers.spec import TrainerSpec

JOBS = "/v1/fine_tuning/jobs"
PUBLIC = "93.184.215.14"  # a global unicast address the checks accept


def _mlflow(uri: str) -> list[dict]:
    return [{"type": "mlflow", "mlflow": {"tracking_uri": uri, "experiment": "x"}}]


@pytest.fixture
def listener():
    with Listener() as target:
        yield target


def test_job_creation_refuses_internal_and_non_http_tracking_uris(
        client, tenant_key, processed_file, listener, tmp_path) -> None:
    headers = tenant_key().headers
    file_id = processed_file(headers)
    port = listener.port
    refused = {
        f"{listener.url}/api/2.0/mlflow/experiments/get-by-name": "tracking_uri_not_public",
        f"http://[::1]:{port}/": "tracking_uri_not_public",
        f"http://localhost:{port}/": "tracking_uri_not_public",
        "http://169.254.169.254/latest/meta-data": "tracking_uri_not_public",
        "http://100.64.0.1/": "tracking_uri_not_public",
        f"http://[2002:7f00:1::1]:{port}/": "tracking_uri_not_public",  # 6to4 of 127.0.0.1
        f"sqlite:///{tmp_path}/mlflow.db": "invalid_tracking_uri",
        f"file://{tmp_path}/mlruns": "invalid_tracking_uri",
        f"http://user:pw@{listener.url.removeprefix('http://')}/": "invalid_tracking_uri",
    }
    for uri, code in refused.items():
        response = client.post(JOBS, headers=headers, json={
            "model": "tunefleet-tiny-llama", "training_file": file_id, "integrations": _mlflow(uri)})
        assert response.status_code == 400, uri
        error = response.json()["error"]
        assert (error["code"], error["param"]) == (code, "integrations[0].mlflow.tracking_uri"), uri
    assert listener.hits == []


def test_an_operator_allowed_tracking_host_is_accepted(client, tenant_key, processed_file, settings) -> None:
    client.app.state.settings = settings.model_copy(
        update={"tracker_allowed_hosts": "mlflow.tracking.svc:5000"})
    headers = tenant_key().headers
    response = client.post(JOBS, headers=headers, json={
        "model": "tunefleet-tiny-llama", "training_file": processed_file(headers),
        "integrations": _mlflow("http://mlflow.tracking.svc:5000")})
    assert response.status_code == 200, response.text



def _tracker_spec(tmp_path: Path, uri: str) -> TrainerSpec:
    return TrainerSpec.model_validate({
        "job_id": "ftjob-ssrf", "trainer": "fsdp_qlora", "model": {"path": str(tmp_path / "model")},
        "data": {"train_file": str(tmp_path / "train.jsonl"), "format": "chat", "max_seq_len": 64},
        "hyperparameters": {"n_epochs": 1, "batch_size": 2, "micro_batch_size": 1, "learning_rate": 1e-3},
        "output_dir": str(tmp_path / "out"), "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "integrations": [{"type": "mlflow", "tracking_uri": uri}],
    })


@pytest.fixture
def quick_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """One short try per MLflow call, so a refused or unanswered call ends the test fast."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setenv("MLFLOW_ALLOW_HTTP_REDIRECTS", "true")  # MLflow's default


def test_the_trainer_does_not_follow_a_tracker_redirect_to_another_target(
        listener, quick_mlflow, tmp_path, monkeypatch) -> None:
    from trainers.common.integrations import TRACKER_ALLOWED_HOSTS_ENV, mirror_from_spec

    def redirect(method: str, path: str) -> tuple[int, dict[str, str], object]:
        return 307, {"Location": listener.url + path}, {}

    with Listener(redirect) as tracker:
        monkeypatch.setenv(TRACKER_ALLOWED_HOSTS_ENV, f"127.0.0.1:{tracker.port}")
        warnings: list[str] = []
        mirror = mirror_from_spec(_tracker_spec(tmp_path, tracker.url), warn=warnings.append)
        assert mirror is not None and mirror.trackers == []
        mirror.close()
    assert listener.hits == []
    assert warnings == ["mlflow integration not started (RestException); the trainer log has the details"]


def test_the_trainer_connects_to_the_checked_tracker_address_not_a_rebound_one(
        listener, quick_mlflow, tmp_path, monkeypatch) -> None:
    from trainers.common.integrations import mirror_from_spec

    real_getaddrinfo = socket.getaddrinfo
    answers: list[str] = []

    def rebinding_dns(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "mlflow.rebind.test":
            return real_getaddrinfo(host, port, *args, **kwargs)
        # Public for the trainer's check, the loopback for any lookup after it.
        address = PUBLIC if not answers else "127.0.0.1"
        answers.append(address)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port)))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding_dns)
    mirror = mirror_from_spec(_tracker_spec(tmp_path, f"http://mlflow.rebind.test:{listener.port}"),
                              warn=lambda message: None)
    assert mirror is not None
    mirror.close()
    assert listener.hits == []
    assert answers == [PUBLIC]  # the connection used the checked address, not a second answer


def test_the_adapter_goes_only_to_artifacts_the_tracking_server_proxies(
        quick_mlflow, tmp_path, monkeypatch) -> None:
    from trainers.common.integrations import TRACKER_ALLOWED_HOSTS_ENV, mirror_from_spec

    elsewhere = tmp_path / "trainer-disk"  # a location of the server's choosing, not its own
    run = {"info": {"run_id": "r1", "experiment_id": "1", "status": "RUNNING",
                    "artifact_uri": elsewhere.as_uri()}, "data": {}}
    answers = {"experiments/get-by-name": {"experiment": {"experiment_id": "1", "name": "tunefleet"}},
               "runs/search": {"runs": []}, "runs/create": {"run": run}, "runs/get": {"run": run},
               "runs/update": {"run_info": run["info"]}}

    def mlflow_api(method: str, path: str) -> tuple[int, dict[str, str], object]:
        call = path.split("?")[0].removeprefix("/api/2.0/mlflow/")
        return 200, {"Content-Type": "application/json"}, answers.get(call, {})

    out = tmp_path / "out"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    with Listener(mlflow_api) as tracker:
        monkeypatch.setenv(TRACKER_ALLOWED_HOSTS_ENV, f"127.0.0.1:{tracker.port}")
        warnings: list[str] = []
        mirror = mirror_from_spec(_tracker_spec(tmp_path, tracker.url), warn=warnings.append)
        assert mirror is not None and [t.name for t in mirror.trackers] == ["mlflow"]
        mirror.add({"type": "artifacts", "location": str(out), "files": []})
        mirror.close()
    assert not elsewhere.exists()
    assert warnings == ["mlflow mirroring stopped (ValueError); the trainer log has the details"]
