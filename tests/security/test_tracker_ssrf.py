"""A job's MLflow ``tracking_uri`` cannot make the trainer call into the service's network.

The probe: a tenant set ``tracking_uri`` to ``http://127.0.0.1:PORT/...``; the trainer
fetched it and the answer's body landed in the tenant's job events. ``sqlite:`` and
``file:`` URIs wrote on the trainer's filesystem.
"""

from __future__ import annotations

import pytest

from tests.security.listener import Listener

JOBS = "/v1/fine_tuning/jobs"


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

