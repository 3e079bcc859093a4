"""The Kubernetes executor against the fake API server, through the unmodified official client."""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

from scheduling.placement import Placement
from tests.k8s.conftest import NAMESPACE
from tests.worker.builders import mi300x, rtx4090
from trainers.spec import TrainerSpec
from worker.executors.base import ObservedKind, StopReason
from worker.executors.kubernetes import KubernetesExecutor
from worker.executors.manifests import SPEC_FILE, ManifestOptions

FAKE_TRAINER = str(Path(__file__).with_name("fake_trainer.py"))


@dataclass
class Row:
    id: str
    tenant_id: str = "org-1"
    priority: int = 50


def spec(job_id: str) -> TrainerSpec:
    return TrainerSpec.model_validate({
        "job_id": job_id, "trainer": "fsdp_qlora", "model": {"path": "/models/tiny"},
        "data": {"train_file": "/data/train.jsonl", "format": "chat"},
        "hyperparameters": {"n_epochs": 1, "batch_size": 2, "micro_batch_size": 1, "learning_rate": 1e-4},
        "output_dir": "/out", "checkpoint": {"dir": "/ckpt"},
        "report": {"url": "http://api/internal", "token": "tok-" + job_id}})


_started = []


@pytest.fixture(autouse=True)
def _close_executors():
    yield
    while _started:
        _started.pop().close()


def executor(api, mode="succeed", start=True, **kw):
    ex = KubernetesExecutor(
        api.api_client(), [mi300x(2), rtx4090(2)],
        options=ManifestOptions(namespace=NAMESPACE, termination_grace_period_s=5),
        command=[sys.executable, FAKE_TRAINER, "--spec", SPEC_FILE], extra_env={"FAKE_TRAINER_MODE": mode},
        watch_timeout_s=1, **kw)
    if start:  # background informers, as in the service
        ex.start()
        _started.append(ex)
    return ex


def placement(pool="rtx4090", nodes=1, gpn=1, trainer="fsdp_qlora"):
    return Placement("fit", pool=pool, gpus=nodes * gpn, nodes=tuple((f"{pool}-{i}", gpn) for i in range(nodes)),
                     trainer=trainer)


def until(api, ex, pred, timeout=20.0):
    seen = []

    def check():
        seen.extend(ex.reconcile())
        return pred(seen)
    api.wait_for(check, timeout=timeout, interval=0.1)
    return seen


def kinds(changes):
    return [c.kind for c in changes]


def test_launch_runs_the_pod_and_succeeds(fake_api):
    ex = executor(fake_api)
    ex.launch(Row("ftjob-Ok1"), spec("ftjob-Ok1"), placement())
    ex.launch(Row("ftjob-Ok1"), spec("ftjob-Ok1"), placement())  # idempotent
    seen = until(fake_api, ex, lambda s: ObservedKind.SUCCEEDED in kinds(s))
    assert seen[-1].kind == ObservedKind.SUCCEEDED
    out = json.loads(ex.logs("ftjob-Ok1").splitlines()[0])
    assert out["job_id"] == "ftjob-Ok1" and out["env"]["TUNEFLEET_REPORT_TOKEN"] == "tok-ftjob-Ok1"
    assert out["env"]["NPROC_PER_NODE"] == "1"
    assert len(client.BatchV1Api(fake_api.api_client()).list_namespaced_job(NAMESPACE).items) == 1


def test_multi_node_indexed_job_gets_service_and_rank_env(fake_api):
    ex = executor(fake_api)
    ex.launch(Row("ftjob-Multi"), spec("ftjob-Multi"), placement("mi300x", nodes=2, gpn=8, trainer="jax_lora"))
    until(fake_api, ex, lambda s: ObservedKind.SUCCEEDED in kinds(s))
    core = client.CoreV1Api(fake_api.api_client())
    pods = core.list_namespaced_pod(NAMESPACE, label_selector="tunefleet.io/job-id=ftjob-Multi").items
    envs = sorted((json.loads(core.read_namespaced_pod_log(p.metadata.name, NAMESPACE).splitlines()[0])["env"]
                   for p in pods), key=lambda e: e["JAX_PROCESS_ID"])
    assert [e["JAX_PROCESS_ID"] for e in envs] == ["0", "1"]
    assert all(e["JAX_NUM_PROCESSES"] == "2" for e in envs)
    assert envs[0]["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:8476"  # the fake's DNS for <job>-0.<svc>
    assert {p.spec.node_name for p in pods} == {"mi300x-0", "mi300x-1"}
    svcs = core.list_namespaced_service(NAMESPACE, label_selector="tunefleet.io/job-id=ftjob-Multi").items
    assert [s.spec.cluster_ip for s in svcs] == ["None"]


def test_user_error_carries_the_termination_message(fake_api):
    ex = executor(fake_api, mode="user_error")
    ex.launch(Row("ftjob-Bad"), spec("ftjob-Bad"), placement())
    seen = until(fake_api, ex, lambda s: ObservedKind.FAILED in kinds(s))
    fail = seen[-1]
    assert (fail.error_code, fail.exit_code) == ("invalid_dataset", 10)
    assert fail.message == "line 3: messages must be a list"


def test_oom_killed_is_a_clear_error(fake_api):
    ex = executor(fake_api, mode="sleep")
    ex.launch(Row("ftjob-Oom"), spec("ftjob-Oom"), placement())
    until(fake_api, ex, lambda s: ObservedKind.STARTED in kinds(s))
    pod = fake_api.cluster.pods("ftjob-Oom")[0]["metadata"]["name"]
    fake_api.cluster.oom_kill(pod)
    fail = until(fake_api, ex, lambda s: ObservedKind.FAILED in kinds(s))[-1]
    assert fail.error_code == "out_of_memory" and "OOM-killed" in fail.message and fail.exit_code == 137


def test_image_pull_backoff_fails_the_job_and_cleans_up(fake_api):
    fake_api.cluster.fail_image("ghcr.io/tunefleet/trainer-torch-cuda:0.1.0")
    ex = executor(fake_api)
    ex.launch(Row("ftjob-Img"), spec("ftjob-Img"), placement())
    fail = until(fake_api, ex, lambda s: ObservedKind.FAILED in kinds(s))[-1]
    assert fail.error_code == "image_pull_failed"
    assert "ghcr.io/tunefleet/trainer-torch-cuda:0.1.0 could not be pulled (ImagePullBackOff)" in fail.message
    batch = client.BatchV1Api(fake_api.api_client())
    fake_api.wait_for(lambda: not batch.list_namespaced_job(NAMESPACE).items)
    core = client.CoreV1Api(fake_api.api_client())
    fake_api.wait_for(lambda: not core.list_namespaced_config_map(NAMESPACE).items)  # owned objects collected


def test_eviction_requeues(fake_api):
    ex = executor(fake_api, mode="sleep")
    ex.launch(Row("ftjob-Evi"), spec("ftjob-Evi"), placement())
    until(fake_api, ex, lambda s: ObservedKind.STARTED in kinds(s))
    fake_api.cluster.evict(fake_api.cluster.pods("ftjob-Evi")[0]["metadata"]["name"])
    ch = until(fake_api, ex, lambda s: ObservedKind.REQUEUE in kinds(s))[-1]
    assert ch.error_code == "evicted" and "requeued" in ch.message


def test_unschedulable_is_reported_as_waiting(fake_api):
    ex = executor(fake_api)
    ex.launch(Row("ftjob-Big"), spec("ftjob-Big"), placement(gpn=3))  # no 4090 node has 3 GPUs
    ch = until(fake_api, ex, lambda s: ObservedKind.WAITING in kinds(s))[-1]
    assert "0/4 nodes are available" in ch.message and "Insufficient nvidia.com/gpu" in ch.message


def test_stop_sigterms_and_reports_the_reason(fake_api):
    ex = executor(fake_api, mode="sleep")
    ex.launch(Row("ftjob-Pre"), spec("ftjob-Pre"), placement())
    until(fake_api, ex, lambda s: ObservedKind.STARTED in kinds(s))
    fake_api.wait_for(lambda: "ftjob-Pre" in ex.logs("ftjob-Pre"))  # the trainer is up
    assert ex.snapshot().running["ftjob-Pre"].stopping is False
    ex.stop(Row("ftjob-Pre"), StopReason.PREEMPT)
    ch = until(fake_api, ex, lambda s: ObservedKind.STOPPED in kinds(s))[-1]
    assert ch.stop_reason == StopReason.PREEMPT
    # 12 when the watch saw the pod terminate; None when the Job's foreground deletion
    # removed the pod first (both happen). The checkpoint below is what must hold.
    assert ch.exit_code in (12, None)
    uids = {o["metadata"]["uid"] for _, r, _, _, o in fake_api.cluster.history
            if r == "pods" and o["metadata"]["labels"].get("tunefleet.io/job-id") == "ftjob-Pre"}
    assert any("SIGTERM: checkpoint written" in fake_api.cluster.read_log(uid) for uid in uids)


def test_snapshot_counts_pool_gpus_minus_our_pods(fake_api):
    ex = executor(fake_api, mode="sleep")
    snap = ex.snapshot()
    assert snap.pool_total("mi300x") == 16 and snap.pool_free("rtx4090") == 4
    ex.launch(Row("ftjob-Snap", priority=25), spec("ftjob-Snap"), placement(gpn=2))
    snap = ex.snapshot()  # pods may not exist yet: the launch still holds its GPUs
    assert snap.pool_free("rtx4090") == 2
    until(fake_api, ex, lambda s: ObservedKind.STARTED in kinds(s))
    snap = ex.snapshot()
    assert snap.pool_free("rtx4090") == 2
    held = snap.running["ftjob-Snap"]
    assert (held.tenant, held.priority, held.gpus) == ("org-1", 25, 2)
    ex.stop(Row("ftjob-Snap"), StopReason.CANCEL)
    until(fake_api, ex, lambda s: ObservedKind.STOPPED in kinds(s))


def test_watch_resumes_and_relists_after_410(fake_api):
    ex = executor(fake_api, start=False)
    ex.sync()
    assert ex.pods.relists == 1
    rv = ex.pods.resource_version
    ex.launch(Row("ftjob-W"), spec("ftjob-W"), placement())
    fake_api.wait_for(lambda: fake_api.cluster.pods("ftjob-W"))
    ex.pods.run_once(timeout_s=1)
    assert ex.pods.relists == 1 and int(ex.pods.resource_version) > int(rv)  # resumed, no relist
    fake_api.cluster.expire_history()
    ex.pods.run_once(timeout_s=1)  # 410 Gone
    assert ex.pods.resource_version is None
    ex.pods.run_once(timeout_s=1)
    assert ex.pods.relists == 2 and any(
        (p.metadata.labels or {}).get("tunefleet.io/job-id") == "ftjob-W" for p in ex.pods.snapshot())
    until(fake_api, ex, lambda s: ObservedKind.SUCCEEDED in kinds(s))
