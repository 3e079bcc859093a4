"""A job on a base model whose files are not there is refused at creation.

The registry may list a local model whose directory was never built or downloaded (plain
``tunefleet serve`` lists the demo model, whose files only ``--demo`` writes). Such a job
could never load its model, and the estimator will not guess its shape, so creating it
is a 400 ``model_unavailable`` naming the model and what is missing; estimates say the
same. ``s3://`` models are not looked up at creation (their trainer reports a missing
prefix as ``model_not_found`` when it starts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.api.test_fleet import LLAMA_8B_CONFIG, POOLS_YAML
from tests.conftest import make_settings


@pytest.fixture
def settings(settings, tmp_path: Path):
    """The suite's settings plus a registry with a present, a missing, a config-less
    and an S3 model."""
    present = tmp_path / "models" / "present"
    present.mkdir(parents=True)
    (present / "config.json").write_text(json.dumps(LLAMA_8B_CONFIG))
    no_config = tmp_path / "models" / "no-config"
    no_config.mkdir()
    (no_config / "tokenizer.json").write_text("{}")
    pools = tmp_path / "node_pools.yaml"
    pools.write_text(POOLS_YAML)
    models = tmp_path / "base_models.yaml"
    models.write_text(
        "models:\n"
        f"  - {{id: present, path: '{present}', max_seq_len: 2048}}\n"
        f"  - {{id: never-built, path: '{tmp_path / 'models' / 'never-built'}', params_b: 0.0001, max_seq_len: 512}}\n"
        f"  - {{id: no-config, path: '{no_config}', params_b: 8.0, max_seq_len: 2048}}\n"
        "  - {id: remote, path: 's3://models/llama-2-7b', params_b: 6.7, max_seq_len: 2048}\n"
    )
    return make_settings(settings.data_path, database_url=settings.resolved_database_url,
                         node_pools_file=pools, base_models_file=models)


@pytest.mark.parametrize("model, missing", [
    ("never-built", "does not exist"),
    ("no-config", "has no config.json"),
])
def test_a_job_on_a_model_without_its_files_is_400_model_unavailable(
    client, tenant_key, processed_file, model, missing
) -> None:
    a = tenant_key()
    body = {"model": model, "training_file": processed_file(a.headers), "adapter": {"method": "qlora"}}
    response = client.post("/v1/fine_tuning/jobs", headers=a.headers, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_unavailable", "model")
    assert f"'{model}'" in error["message"] and missing in error["message"], error
    # Nothing was created, and the estimate refuses to guess its shape too.
    assert client.get("/v1/fine_tuning/jobs", headers=a.headers).json()["data"] == []
    estimate = client.post("/v1/fine_tuning/estimate", headers=a.headers, json={"model": model})
    assert estimate.status_code == 400, estimate.text
    assert (estimate.json()["error"]["code"], estimate.json()["error"]["param"]) == ("model_unavailable", "model")


def test_models_with_their_files_or_on_s3_are_created(client, tenant_key, processed_file) -> None:
    a = tenant_key()
    for model in ("present", "remote"):
        body = {"model": model, "training_file": processed_file(a.headers), "adapter": {"method": "qlora"}}
        response = client.post("/v1/fine_tuning/jobs", headers=a.headers, json=body)
        assert response.status_code == 200, (model, response.text)
    shown = client.get("/v1/fine_tuning/jobs", headers=a.headers).json()["data"]
    sources = {j["model"]: j["estimate"]["model"]["shape_source"] for j in shown}
    assert sources == {"present": "config.json", "remote": "nearest known model llama-2-7b (params_b 6.7)"}
