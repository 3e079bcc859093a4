"""``GET /v1/fine_tuning/jobs/{id}/logs`` in Kubernetes mode: the trainer pod's own log.

The API app (``create_app`` with ``TUNEFLEET_EXECUTOR=kubernetes``) reads it from the fake
API server through a kubeconfig, as a pod would with its service account, and asks for
nothing but what the chart's ``<fullname>-api-logs`` Role grants.
"""

import json
import sys
from pathlib import Path

import yaml
from fastapi.testclient import TestClient

from api.main import create_app
from scheduling.placement import Placement
from tests.api.conftest import make_job, processed_file, upload  # noqa: F401 (fixtures)
from tests.deploy.chart import one, rendered_docs
from tests.k8s.conftest import NAMESPACE
from tests.k8s.test_kubernetes_executor import spec
from tests.worker.builders import rtx4090
from worker.executors.kubernetes import KubernetesExecutor
from worker.executors.manifests import SPEC_FILE, ManifestOptions
from worker.scheduler.store import JobHandle

FAKE_TRAINER = str(Path(__file__).with_name("fake_trainer.py"))


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "api", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "api"}}]}))
    return path


def test_the_logs_route_serves_the_trainer_pods_log(fake_api, settings, inline_queue, tenant_key, make_job,  # noqa: F811
                                                    tmp_path, monkeypatch):
    key = tenant_key()
    job_id = make_job(key.headers)["id"]
    other = make_job(key.headers)["id"]  # never launched: no pod
    ex = KubernetesExecutor(fake_api.api_client(), [rtx4090(2)], options=ManifestOptions(namespace=NAMESPACE),
                            command=[sys.executable, FAKE_TRAINER, "--spec", SPEC_FILE],
                            extra_env={"FAKE_TRAINER_MODE": "succeed"})
    ex.launch(JobHandle(job_id, key.tenant_id, 50), spec(job_id),
              Placement("fit", pool="rtx4090", gpus=1, nodes=(("rtx4090-0", 1),), trainer="fsdp_qlora"))
    fake_api.wait_for(lambda: job_id in ex.logs(job_id))

    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "kubeconfig", fake_api.url)))
    k8s_settings = settings.model_copy(update={"executor": "kubernetes", "k8s_namespace": NAMESPACE})
    fake_api.cluster.requests.clear()
    with TestClient(create_app(k8s_settings, queue=inline_queue)) as api:
        got = api.get(f"/v1/fine_tuning/jobs/{job_id}/logs", headers=key.headers)
        none = api.get(f"/v1/fine_tuning/jobs/{other}/logs", headers=key.headers)
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
    assert json.loads(got.text.splitlines()[0])["job_id"] == job_id  # what the trainer printed
    assert (none.status_code, none.text) == (200, "")
    asked = set(fake_api.cluster.requests)
    role = one(rendered_docs("default"), "Role", "tf-tunefleet-api-logs")
    granted = {(verb, resource) for rule in role["rules"] for verb in rule["verbs"] for resource in rule["resources"]}
    assert asked == granted == {("list", "pods"), ("get", "pods/log")}
