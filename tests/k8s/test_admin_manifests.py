"""`tunefleet admin manifests`: the executor's objects for a job body, created nowhere.

A real training file goes through the API (upload + validation); the command then reads
the service's settings from the environment, as an operator's shell would give them.
"""

from __future__ import annotations

import json
import os
import shutil

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from tunefleet.cli.manifests import TOKEN_PLACEHOLDER

POOLS = """
pools:
  - name: rtx4090
    accelerator: nvidia-rtx-4090
    gpu_memory_gib: 24
    gpus_per_node: 2
    resource_name: nvidia.com/gpu
    node_selector: {tunefleet.io/pool: rtx4090}
    tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
    trainer: fsdp_qlora
    trainer_image: registry.internal/trainer-torch-cuda:0.1.0
    max_nodes_per_job: 4
    peak_tflops: 165
    trainer_resources: {cpu_per_gpu: 6, memory_gib_per_gpu: 24}
"""


@pytest.fixture
def cli_env(settings, tmp_path, monkeypatch):
    """The CLI's settings: the test database and data dir, the pools above, trainer options,
    and the files of the demo model the registry lists (a job on a model without them is
    refused)."""
    from control.settings import get_settings
    from tests.model_files import install_demo_model

    install_demo_model(settings.models_dir)

    pools = tmp_path / "pools.yaml"
    pools.write_text(POOLS, encoding="utf-8")
    for name in [k for k in os.environ if k.startswith("TUNEFLEET_")]:
        monkeypatch.delenv(name)
    env = {
        "TUNEFLEET_ENV": "test", "TUNEFLEET_DATA_DIR": str(settings.data_path),
        "TUNEFLEET_DATABASE_URL": settings.resolved_database_url,
        "TUNEFLEET_BROKER_URL": settings.resolved_broker_url, "TUNEFLEET_EXECUTOR": "kubernetes",
        "TUNEFLEET_NODE_POOLS_FILE": str(pools), "TUNEFLEET_K8S_NAMESPACE": "ml-training",
        "TUNEFLEET_K8S_TRAINER_SECRET": "trainer-s3-keys",
        "TUNEFLEET_K8S_TRAINER_SERVICE_ACCOUNT": "tunefleet-trainer",
        "TUNEFLEET_K8S_TRAINER_PRIORITY_CLASS": "training-batch",
        "TUNEFLEET_K8S_TRAINER_MAX_RUNTIME_S": "86400",
        "TUNEFLEET_S3_ENDPOINT_URL": "https://s3.storage.internal:9000", "AWS_DEFAULT_REGION": "eu-west-1",
    }  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()


def _invoke(*args: str):
    from tunefleet.cli import app

    return CliRunner().invoke(app, ["admin", "manifests", *args])


def _training_file(client, tenant_key) -> str:
    rows = [{"messages": [{"role": "user", "content": f"{i} + {i}?"}, {"role": "assistant", "content": f"{2 * i}"}]}
            for i in range(16)]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    response = client.post("/v1/files", headers=tenant_key().headers, data={"purpose": "fine-tune"},
                           files={"file": ("train.jsonl", data, "application/jsonl")})
    assert response.status_code == 200, response.text
    assert client.get(f"/v1/files/{response.json()['id']}", headers=response.request.headers).json()[
        "status"] == "processed"
    return response.json()["id"]


def test_prints_every_object_of_a_multi_node_job_as_the_executor_renders_it(
        client, tenant_key, cli_env, tmp_path):
    body = tmp_path / "job.json"
    body.write_text(json.dumps({
        "model": "tunefleet-tiny-llama", "training_file": _training_file(client, tenant_key),
        "adapter": {"method": "qlora"}, "placement": {"gpus": 4}, "priority": "high",
    }), encoding="utf-8")
    result = _invoke("--pool", "rtx4090", "--body", str(body))
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.output))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Secret", "Service", "Job"]
    for doc in docs:
        assert doc["metadata"]["namespace"] == "ml-training"
        for version in ("1.30", "1.33"):
            kubernetes_validate.validate(doc, version, strict=True)
    configmap, secret, _, job = docs
    spec = json.loads(configmap["data"]["spec.json"])
    assert spec["report"]["token"] is None and secret["stringData"] == {"token": TOKEN_PLACEHOLDER}
    assert spec["parallelism"]["world_size"] == 4 and spec["trainer"] == "fsdp_qlora"
    assert job["spec"]["completions"] == 2 and job["spec"]["completionMode"] == "Indexed"
    assert job["metadata"]["labels"]["tunefleet.io/priority"] == "75"
    pod = job["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    # 2 GPUs a pod, 6 CPUs and 24 GiB a GPU from the pools file
    assert trainer["resources"] == {"requests": {"cpu": "12", "memory": "48Gi", "nvidia.com/gpu": "2"},
                                    "limits": {"memory": "48Gi", "nvidia.com/gpu": "2"}}
    assert trainer["securityContext"]["readOnlyRootFilesystem"] is True
    assert trainer["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert [r["action"] for r in job["spec"]["podFailurePolicy"]["rules"]] == [
        "Count", "FailJob", "FailJob", "Count"]
    # the credential wiring, priority and deadline from the settings
    assert trainer["envFrom"] == [{"secretRef": {"name": "trainer-s3-keys"}}]
    assert pod["serviceAccountName"] == "tunefleet-trainer" and pod["automountServiceAccountToken"] is False
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["TUNEFLEET_S3_ENDPOINT_URL"] == "https://s3.storage.internal:9000"
    assert env["AWS_DEFAULT_REGION"] == "eu-west-1"
    assert pod["priorityClassName"] == "training-batch" and job["spec"]["activeDeadlineSeconds"] == 86400


def test_creates_nothing(client, tenant_key, cli_env, tmp_path, settings):
    from sqlalchemy import func, select

    from control.db.models import Job
    from control.db.session import session_scope

    body = tmp_path / "job.json"
    body.write_text(json.dumps({"model": "tunefleet-tiny-llama",
                                "training_file": _training_file(client, tenant_key)}), encoding="utf-8")
    result = _invoke("--pool", "rtx4090", "--body", str(body), "--json")
    assert result.exit_code == 0, result.output
    assert [d["kind"] for d in json.loads(result.output)["data"]] == ["ConfigMap", "Secret", "Job"]
    with session_scope(settings.resolved_database_url) as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0


@pytest.mark.parametrize(("args", "body", "code", "param"), [
    (["--pool", "a100"], {"model": "tunefleet-tiny-llama", "training_file": "file-x"}, "invalid_pool", "pool"),
    (["--pool", "rtx4090"], {"model": "tunefleet-tiny-llama", "training_file": "file-x", "priority": "urgent"},
     "invalid_request", "priority"),
    (["--pool", "rtx4090"], {"model": "tunefleet-tiny-llama", "training_file": "file-missing"},
     "invalid_file", "training_file"),
    (["--pool", "rtx4090"], {"model": "llama-9000", "training_file": "file-x"}, "invalid_model", "model"),
    (["--pool", "rtx4090"], {"model": "tunefleet-tiny-llama", "training_file": "file-x",
                             "placement": {"gpus": 16}}, "no_fit", "placement"),
])
def test_a_body_that_cannot_run_there_says_why(args, body, code, param, cli_env, tmp_path, client, tenant_key):
    if body["training_file"] == "file-x":
        body = {**body, "training_file": _training_file(client, tenant_key)}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(body), encoding="utf-8")
    result = _invoke(*args, "--body", str(path), "--json")
    assert result.exit_code == 2, result.output
    error = json.loads(result.output.strip().splitlines()[-1])["error"]
    assert (error["code"], error["param"]) == (code, param), error


def test_a_model_without_its_files_is_a_clear_error(cli_env, tmp_path, client, tenant_key, settings):
    body = {"model": "tunefleet-tiny-llama", "training_file": _training_file(client, tenant_key)}
    shutil.rmtree(settings.models_dir)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(body), encoding="utf-8")
    result = _invoke("--pool", "rtx4090", "--body", str(path), "--json")
    assert result.exit_code == 2, result.output
    error = json.loads(result.output.strip().splitlines()[-1])["error"]
    assert (error["code"], error["param"]) == ("model_unavailable", "model"), error
