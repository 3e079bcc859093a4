"""End to end on the fake cluster: API -> queue -> scheduler places on a pool -> a
Kubernetes Job -> the pod runs the real trainer -> reports back -> succeeded.

The real processes of the service (API, worker, ``tunefleet scheduler`` with
``TUNEFLEET_EXECUTOR=kubernetes``) talk to the fake API server through a kubeconfig,
with the unmodified official client; the fake kubelet runs the pod's
``python -m trainers --spec /etc/tunefleet/spec/spec.json`` as a local process.
"""

import json

import pytest
import yaml

from tests.e2e.conftest import service, tiny_model_dir  # noqa: F401 (fixtures)
from tests.e2e.test_local_training import upload, wait_for
from tests.k8s.fake_apiserver import FakeApiServer
from tunefleet.demo import demo_examples

pytestmark = pytest.mark.slow
NS = "tunefleet-training"


def _start_on_one_node_cluster(start_service, api, tmp_path):
    """One CPU node in pool ``cpu`` of the fake cluster; the service's executor is Kubernetes."""
    c = api.cluster
    c.create("namespaces", "", {"metadata": {"name": NS}})
    c.add_node("cpu-0", labels={"tunefleet.io/pool": "cpu"}, gpus=0, resource_name=None)
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": NS}}]}))
    (tmp_path / "pools.yaml").write_text(yaml.safe_dump({"pools": [{
        "name": "cpu", "accelerator": "cpu", "gpu_memory_gib": 8, "gpus_per_node": 1,
        "node_selector": {"tunefleet.io/pool": "cpu"}, "trainers": ["fsdp_qlora"],
        "trainer_image": "tunefleet-trainer:test", "peak_tflops": 0.5, "nodes": 1}]}))
    svc = start_service("embedded", TUNEFLEET_EXECUTOR="kubernetes", KUBECONFIG=str(tmp_path / "kubeconfig"),
                  TUNEFLEET_NODE_POOLS_FILE=str(tmp_path / "pools.yaml"), TUNEFLEET_K8S_NAMESPACE=NS)
    return c, svc


def test_job_trains_in_a_pod_of_the_fake_cluster(service, tmp_path):  # noqa: F811
    with FakeApiServer(tmp_path / "k8s") as api:
        c, svc = _start_on_one_node_cluster(service, api, tmp_path)
        with svc.http() as http:
            file_id = upload(http, demo_examples()[:32])
            job = http.post("/fine_tuning/jobs", json={
                "model": "tunefleet-tiny-llama", "training_file": file_id, "seed": 3,
                "hyperparameters": {"n_epochs": 1, "batch_size": 8}, "max_seq_len": 48,
                "adapter": {"method": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"]}}).json()
            try:
                done = wait_for(lambda: (j := http.get(f"/fine_tuning/jobs/{job['id']}").json())["status"]
                                in ("succeeded", "failed", "cancelled") and j, 240, "the job to finish")
            except AssertionError:
                pods = c.pods(job["id"])
                print(svc.dump_logs(), *(c.read_log(p["metadata"]["uid"])[-3000:] for p in pods))
                raise
            if done["status"] != "succeeded":
                pods = c.pods(job["id"])
                print(svc.dump_logs(), *(c.read_log(p["metadata"]["uid"])[-3000:] for p in pods))
            assert done["status"] == "succeeded", done.get("error")
            assert done["pool"] == "cpu" and done["usage"]["gpu_seconds"] > 0
            assert (done["trained_tokens"] or 0) > 0  # the trainer in the pod reported its metrics
            metrics = http.get(f"/fine_tuning/jobs/{job['id']}/metrics").json()["data"]
            assert metrics and metrics[-1]["train_loss"] is not None
            names = {a["name"] for a in http.get(f"/fine_tuning/jobs/{job['id']}/artifacts").json()["data"]}
            assert "adapter/adapter_model.safetensors" in names  # the PEFT adapter came back
            events = [e["message"] for e in http.get(f"/fine_tuning/jobs/{job['id']}/events?limit=100").json()["data"]]
            assert any("Admitted on pool cpu" in m for m in events)
        jobs = [o for _, r, _, _, o in c.history if r == "jobs"]
        assert jobs and jobs[0]["spec"]["template"]["spec"]["nodeSelector"] == {"tunefleet.io/pool": "cpu"}
        spec_cm = next(o for _, r, _, _, o in c.history if r == "configmaps")
        assert json.loads(spec_cm["data"]["spec.json"])["report"]["token"] is None
        assert ("create", "jobs") in c.requests


def test_preemption_checkpoints_requeues_and_resumes_on_the_fake_cluster(service, tmp_path):  # noqa: F811
    """A high-priority job preempts a running low-priority one on a 1-slot pool: the victim's
    pod gets SIGTERM, checkpoints, is requeued with resume_from, and later resumes in a new
    Kubernetes Job, continuing its step count (no step trained twice, none skipped)."""
    with FakeApiServer(tmp_path / "k8s") as api:
        c, svc = _start_on_one_node_cluster(service, api, tmp_path)
        body = {"model": "tunefleet-tiny-llama", "seed": 3, "max_seq_len": 48,
                "adapter": {"method": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"]}}
        with svc.http() as http:
            file_id = upload(http, demo_examples()[:32])
            low = http.post("/fine_tuning/jobs", json={**body, "training_file": file_id, "priority": "low",
                                                        "hyperparameters": {"n_epochs": 40, "batch_size": 4}}).json()
            get = lambda jid: http.get(f"/fine_tuning/jobs/{jid}").json()  # noqa: E731
            wait_for(lambda: (get(low["id"]).get("current_step") or 0) >= 5, 180, "the low job to train")
            high = http.post("/fine_tuning/jobs", json={**body, "training_file": file_id, "priority": "high",
                                                         "hyperparameters": {"n_epochs": 1, "batch_size": 8}}).json()
            try:
                wait_for(lambda: get(high["id"])["status"] == "succeeded", 240, "the high job")
                done = wait_for(lambda: (j := get(low["id"]))["status"] in ("succeeded", "failed") and j, 400,
                                "the preempted job to resume and finish")
            except AssertionError:
                print(svc.dump_logs(), *(c.read_log(p["metadata"]["uid"])[-2000:] for p in c.pods()))
                raise
            assert done["status"] == "succeeded", done.get("error")
            assert done["resume_from"] and done["restarts"] == 0  # a preemption is not a crash
            assert len(done["usage"]["segments"]) == 2  # held GPUs twice; the queue time in between is free
            events = [e["message"] for e in http.get(f"/fine_tuning/jobs/{low['id']}/events?limit=100").json()["data"]]
            assert any("Preempted by higher-priority job" in m for m in events)
            steps = [m["step"] for m in http.get(f"/fine_tuning/jobs/{low['id']}/metrics?limit=1000").json()["data"]]
            assert steps == list(range(steps[0], steps[0] + len(steps)))  # continuous: one row per step
            assert steps[-1] == done["total_steps"]
        launches = [o["metadata"]["uid"] for _, r, _, t, o in c.history if r == "jobs" and t == "ADDED"
                    and o["metadata"]["labels"].get("tunefleet.io/job-id") == low["id"]]
        assert len(launches) == 2  # the preempted run and the resumed one: two Kubernetes Jobs
