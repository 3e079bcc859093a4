"""End to end on the fake cluster: API -> queue -> scheduler places on a pool -> a
Kubernetes Job -> the pod runs the real trainer -> reports back -> succeeded.

The real processes of the service (API, worker, ``tunefleet scheduler`` with
``TUNEFLEET_EXECUTOR=kubernetes``) talk to the fake API server through a kubeconfig,
with the unmodified official client; the fake kubelet runs the pod's
``python -m trainers --spec /etc/tunefleet/spec/spec.json`` as a local process.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO
from tests.e2e.conftest import service, tiny_model_dir  # noqa: F401 (fixtures)
from tests.e2e.test_local_training import all_metrics, upload, wait_for
from tests.k8s.fake_apiserver import FakeApiServer
from tunefleet.demo import demo_examples

pytestmark = pytest.mark.slow
NS = "tunefleet-training"


CPU_POOL = {
    "name": "cpu", "accelerator": "cpu", "gpu_memory_gib": 8, "gpus_per_node": 1,
    "node_selector": {"tunefleet.io/pool": "cpu"}, "trainers": ["fsdp_qlora"],
    "trainer_image": "tunefleet-trainer:test", "peak_tflops": 0.5, "nodes": 1}


def _start_on_cluster(start_service, api, tmp_path, pools=(CPU_POOL,), **extra_env):
    """One node per pool in the fake cluster -- its labels, a taint per toleration and
    GPUs as the pool says -- and the service, its executor Kubernetes, on those pools."""
    c = api.cluster
    c.create("namespaces", "", {"metadata": {"name": NS}})
    for pool in pools:
        taints = [{"key": t["key"], "effect": t["effect"], **({"value": t["value"]} if "value" in t else {})}
                  for t in pool.get("tolerations", [])]
        c.add_node(f"{pool['name']}-0", labels=pool["node_selector"], gpus=pool["gpus_per_node"],
                   resource_name=pool.get("resource_name"), taints=taints)
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": NS}}]}))
    (tmp_path / "pools.yaml").write_text(yaml.safe_dump({"pools": list(pools)}))
    svc = start_service("embedded", TUNEFLEET_EXECUTOR="kubernetes", KUBECONFIG=str(tmp_path / "kubeconfig"),
                        TUNEFLEET_NODE_POOLS_FILE=str(tmp_path / "pools.yaml"), TUNEFLEET_K8S_NAMESPACE=NS,
                        **extra_env)
    return c, svc


TINY_JOB = {"model": "tunefleet-tiny-llama", "seed": 3, "max_seq_len": 48,
            "hyperparameters": {"n_epochs": 1, "batch_size": 8},
            "adapter": {"method": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"]}}


def _wait_until_done(http, c, svc, job_id, timeout=240):
    """The job once terminal; on a timeout or a failure the service's and pods' logs are printed."""
    try:
        done = wait_for(lambda: (j := http.get(f"/fine_tuning/jobs/{job_id}").json())["status"]
                        in ("succeeded", "failed", "cancelled") and j, timeout, "the job to finish")
    except AssertionError:
        print(svc.dump_logs(), *(c.read_log(p["metadata"]["uid"])[-3000:] for p in c.pods(job_id)))
        raise
    if done["status"] != "succeeded":
        print(svc.dump_logs(), *(c.read_log(p["metadata"]["uid"])[-3000:] for p in c.pods(job_id)))
    return done


def _events(http, job_id):
    return http.get(f"/fine_tuning/jobs/{job_id}/events?limit=100").json()["data"]


def test_job_trains_in_a_pod_of_the_fake_cluster(service, tmp_path):  # noqa: F811
    with FakeApiServer(tmp_path / "k8s") as api:
        c, svc = _start_on_cluster(service, api, tmp_path)
        with svc.http() as http:
            file_id = upload(http, demo_examples()[:32])
            job = http.post("/fine_tuning/jobs", json={**TINY_JOB, "training_file": file_id}).json()
            done = _wait_until_done(http, c, svc, job["id"])
            assert done["status"] == "succeeded", done.get("error")
            assert done["pool"] == "cpu" and done["usage"]["gpu_seconds"] > 0
            assert (done["trained_tokens"] or 0) > 0  # the trainer in the pod reported its metrics
            metrics = http.get(f"/fine_tuning/jobs/{job['id']}/metrics").json()["data"]
            assert metrics and metrics[-1]["train_loss"] is not None
            names = {a["name"] for a in http.get(f"/fine_tuning/jobs/{job['id']}/artifacts").json()["data"]}
            assert "adapter/adapter_model.safetensors" in names  # the PEFT adapter came back
            assert any("Admitted on pool cpu" in e["message"] for e in _events(http, job["id"]))
        jobs = [o for _, r, _, _, o in c.history if r == "jobs"]
        assert jobs and jobs[0]["spec"]["template"]["spec"]["nodeSelector"] == {"tunefleet.io/pool": "cpu"}
        spec_cm = next(o for _, r, _, _, o in c.history if r == "configmaps")
        assert json.loads(spec_cm["data"]["spec.json"])["report"]["token"] is None
        assert ("create", "jobs") in c.requests


# Two pools running the same trainer; only the second holds the job. The first is listed
# first, faster and cheaper, so only the estimator's memory check keeps the job off it.
# The pod runs on this machine's CPU: the trainer falls back to it, in the GPU pools' bf16.
SMALL_POOL = {
    "name": "small", "accelerator": "nvidia-small", "gpu_memory_gib": 0.5, "gpus_per_node": 2,
    "resource_name": "nvidia.com/gpu", "node_selector": {"tunefleet.io/pool": "small"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "trainers": ["fsdp_qlora"], "trainer_image": "tunefleet-trainer:test", "peak_tflops": 400,
    "price_per_gpu_hour": 0.1, "nodes": 1}
RTX_POOL = {
    "name": "rtx4090", "accelerator": "nvidia-rtx-4090", "gpu_memory_gib": 24, "gpus_per_node": 2,
    "resource_name": "nvidia.com/gpu", "node_selector": {"tunefleet.io/pool": "rtx4090"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                    {"key": "tunefleet.io/pool", "operator": "Equal", "value": "rtx4090", "effect": "NoSchedule"}],
    "trainers": ["fsdp_qlora"], "trainer_image": "tunefleet-trainer:test", "peak_tflops": 165,
    "price_per_gpu_hour": 0.7, "nodes": 1}


def test_the_job_is_placed_on_the_pool_that_holds_it_and_trains_there(service, tmp_path):  # noqa: F811
    """Of two pools the estimator rules out the one whose GPUs are too small: the Job gets
    the other pool's node selector, tolerations and GPU request, and its pod lands on
    that pool's node, runs the real trainer and sends the adapter back."""
    with FakeApiServer(tmp_path / "k8s") as api:
        c, svc = _start_on_cluster(service, api, tmp_path, pools=(SMALL_POOL, RTX_POOL))
        with svc.http() as http:
            file_id = upload(http, demo_examples()[:32])
            job = http.post("/fine_tuning/jobs", json={**TINY_JOB, "training_file": file_id}).json()
            done = _wait_until_done(http, c, svc, job["id"])
            assert done["status"] == "succeeded", done.get("error")
            assert (done["pool"], done["gpus"]) == ("rtx4090", 1)
            small = next(p for p in done["estimate"]["pools"] if p["pool"] == "small")
            assert not small["fits"] and small["memory_per_gpu_bytes"] > small["usable_bytes"], small
            names = {a["name"] for a in http.get(f"/fine_tuning/jobs/{job['id']}/artifacts").json()["data"]}
            assert "adapter/adapter_model.safetensors" in names
            assert any("Admitted on pool rtx4090: 1x nvidia-rtx-4090" in e["message"]
                       for e in _events(http, job["id"]))
        (created,) = [o for _, r, _, t, o in c.history if r == "jobs" and t == "ADDED"]
        pod_spec = created["spec"]["template"]["spec"]
        assert pod_spec["nodeSelector"] == {"tunefleet.io/pool": "rtx4090"}
        assert pod_spec["tolerations"] == RTX_POOL["tolerations"]
        # the pool's GPU, and CPU and memory for it at the pools file's defaults
        assert pod_spec["containers"][0]["resources"] == {
            "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
            "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"}}
        pods = [o for _, r, _, _, o in c.history if r == "pods" and o["spec"].get("nodeName")]
        assert pods and {p["spec"]["nodeName"] for p in pods} == {"rtx4090-0"}


def test_an_image_that_cannot_be_pulled_fails_the_job_with_a_clear_error(service, tmp_path):  # noqa: F811
    """ImagePullBackOff is not retried (another try pulls the same image): the job fails
    with ``image_pull_failed``, a message naming the image and what to check, an error
    event, and its Kubernetes Job is deleted so nothing keeps waiting for the image."""
    with FakeApiServer(tmp_path / "k8s") as api:
        c, svc = _start_on_cluster(service, api, tmp_path)
        c.fail_image(CPU_POOL["trainer_image"])
        with svc.http() as http:
            file_id = upload(http, demo_examples()[:32])
            job = http.post("/fine_tuning/jobs", json={**TINY_JOB, "training_file": file_id}).json()
            done = _wait_until_done(http, c, svc, job["id"], timeout=120)
            assert done["status"] == "failed" and done["error"]["code"] == "image_pull_failed", done["error"]
            message = done["error"]["message"]
            assert "the trainer image tunefleet-trainer:test could not be pulled (ImagePullBackOff)" in message
            assert "check the pool's trainer_image and the registry credentials" in message
            errors = [e for e in _events(http, job["id"]) if e["level"] == "error"]
            assert [e["message"] for e in errors] == [f"Job failed: image_pull_failed: {message}"], errors
        created = [o for _, r, _, t, o in c.history if r == "jobs" and t == "ADDED"]
        assert len(created) == 1  # failed, not requeued into another pull
        api.wait_for(lambda: not c.list("jobs", NS), timeout=10)
        assert not c.procs  # the trainer never started


def _start_uninterrupted_run(c, job_id, workdir):
    """The job's first spec (from its ConfigMap) run straight by the trainer, outside the
    cluster and never stopped: the reference loss curve. Reports, checkpoints and output
    go under ``workdir``; one thread, as the fake kubelet runs pods."""
    cm = next(o for _, r, _, t, o in c.history if r == "configmaps" and t == "ADDED"
              and o["metadata"]["labels"].get("tunefleet.io/job-id") == job_id)
    spec = json.loads(cm["data"]["spec.json"])
    spec["checkpoint"] = {**spec["checkpoint"], "dir": str(workdir / "checkpoints"), "resume_from": None}
    spec["output_dir"] = str(workdir / "output")
    spec["report"] = {**spec["report"], "url": None, "token": None, "spool_dir": None}
    spec["termination_log"] = str(workdir / "termination.json")
    workdir.mkdir(parents=True)
    (workdir / "spec.json").write_text(json.dumps(spec))
    with (workdir / "trainer.log").open("wb") as log:
        return subprocess.Popen([sys.executable, "-m", "trainers", "--spec", str(workdir / "spec.json")], cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT)


def test_preemption_checkpoints_requeues_and_resumes_on_the_fake_cluster(service, tmp_path):  # noqa: F811
    """A high-priority job preempts a running low-priority one on a 1-slot pool: the victim's
    pod gets SIGTERM, checkpoints, is requeued with resume_from, and later resumes in a new
    Kubernetes Job, continuing its loss curve: every step once, each loss that of an
    uninterrupted run of the same spec (same seed, CPU, fp32) within 1e-6."""
    reference = None
    with FakeApiServer(tmp_path / "k8s") as api:
        c, svc = _start_on_cluster(service, api, tmp_path)
        body = {"model": "tunefleet-tiny-llama", "seed": 3, "max_seq_len": 48,
                "adapter": {"method": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"]}}
        try:
            with svc.http() as http:
                file_id = upload(http, demo_examples()[:32])
                low = http.post("/fine_tuning/jobs", json={
                    **body, "training_file": file_id, "priority": "low",
                    "hyperparameters": {"n_epochs": 40, "batch_size": 4}}).json()
                get = lambda jid: http.get(f"/fine_tuning/jobs/{jid}").json()
                wait_for(lambda: (get(low["id"]).get("current_step") or 0) >= 5, 180, "the low job to train")
                reference = _start_uninterrupted_run(c, low["id"], tmp_path / "reference")
                high = http.post("/fine_tuning/jobs", json={
                    **body, "training_file": file_id, "priority": "high",
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
                events = [e["message"] for e in _events(http, low["id"])]
                assert any("Preempted by higher-priority job" in m for m in events)
                rows = all_metrics(http, low["id"])
            launches = [o["metadata"]["uid"] for _, r, _, t, o in c.history if r == "jobs" and t == "ADDED"
                        and o["metadata"]["labels"].get("tunefleet.io/job-id") == low["id"]]
            assert len(launches) == 2  # the preempted run and the resumed one: two Kubernetes Jobs
            assert reference.wait(timeout=300) == 0, (tmp_path / "reference" / "trainer.log").read_text()[-3000:]
        finally:
            if reference is not None and reference.poll() is None:
                reference.kill()
                reference.wait()
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, done["total_steps"] + 1))  # continuous: one row per step
    resumed_at = int(re.search(r"step-(\d+)", done["resume_from"]).group(1))
    assert 5 <= resumed_at < done["total_steps"]  # checkpointed at the SIGTERM, then trained on
    uninterrupted = [json.loads(line) for line in (tmp_path / "reference" / "output" / "metrics.jsonl")
                     .read_text().splitlines()]
    assert [r["step"] for r in uninterrupted] == steps
    for row, ref in zip(rows, uninterrupted, strict=True):
        assert abs(row["train_loss"] - ref["train_loss"]) <= 1e-6, (
            f"step {row['step']} (resumed after step {resumed_at}): {row['train_loss']} vs uninterrupted "
            f"{ref['train_loss']}")
