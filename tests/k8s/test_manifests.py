"""Rendered manifests: valid against the Kubernetes schemas, and saying what we mean."""

import pytest

from scheduling.pools import TrainerResources, local_pool
from tests.worker.builders import mi300x, rtx4090
from trainers.exit_codes import ExitCode
from worker.executors.manifests import (
    ManifestOptions,
    owner_reference,
    pod_resources,
    render_all,
    resource_name,
)

SPEC = {"job_id": "ftjob-AbC", "report": {"token": None}}


def _all(pool, trainer, nodes, gpn, **opts):
    return render_all(job_id="ftjob-AbCdEf0123456789XyZ", tenant="org-1", pool=pool, trainer=trainer, nodes=nodes,
                      gpus_per_node=gpn, spec_json=SPEC, token="s3cret", opts=ManifestOptions(**opts))


CASES = [
    ("jax multi-node", mi300x(), "jax_lora", 2, 8, {}),
    ("torch single node", rtx4090(), "fsdp_qlora", 1, 2, {}),
    ("torch multi-node kueue", rtx4090(), "fsdp_qlora", 3, 2, {"kueue_queue": "team-a"}),
    ("cpu pool, every trainer option", local_pool(2), "fsdp_qlora", 1, 2, {
        "service_account": "trainer", "automount_service_account_token": True, "env_from_secret": "keys",
        "priority_class_name": "batch", "active_deadline_seconds": 3600}),
]


@pytest.mark.parametrize("version", ["1.30", "1.33"])
@pytest.mark.parametrize("name, pool, trainer, nodes, gpn, opts", CASES, ids=[c[0] for c in CASES])
def test_every_manifest_validates(version, name, pool, trainer, nodes, gpn, opts):
    import kubernetes_validate

    m = _all(pool, trainer, nodes, gpn, **opts)
    docs = m.all()
    # the owned objects carry an ownerReference when created; validate that shape too
    job_created = {"metadata": {"name": m.name, "uid": "0f2c8d9e-0000-4000-8000-000000000000"}}
    for doc in docs[:-1]:
        doc["metadata"]["ownerReferences"] = [owner_reference(job_created)]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def _env(job):
    container = job["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_multi_node_jax_is_indexed_with_service_and_env():
    m = _all(mi300x(), "jax_lora", 2, 8)
    job, svc = m.job, m.service
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert svc["spec"]["clusterIP"] == "None"
    assert job["spec"]["template"]["spec"]["subdomain"] == svc["metadata"]["name"]
    env = _env(job)
    assert env["JAX_COORDINATOR_ADDRESS"] == f"{m.name}-0.{m.name}.tunefleet-training.svc:8476"
    assert env["JAX_NUM_PROCESSES"] == "2"
    assert env["JAX_PROCESS_ID"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"tunefleet.io/pool": "mi300x"}
    # 8 GPUs a pod at the defaults (4 CPUs, 16 GiB a GPU): not BestEffort, memory limited
    assert pod["containers"][0]["resources"] == {"requests": {"amd.com/gpu": "8", "cpu": "32", "memory": "128Gi"},
                                                 "limits": {"amd.com/gpu": "8", "memory": "128Gi"}}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]
    assert pod["containers"][0]["terminationMessagePath"] == "/dev/termination-log"


def test_torch_env_and_token_only_in_secret():
    m = _all(rtx4090(), "fsdp_qlora", 3, 2)
    env = _env(m.job)
    assert env["MASTER_ADDR"] == f"{m.name}-0.{m.name}.tunefleet-training.svc"
    assert (env["NNODES"], env["NPROC_PER_NODE"], env["MASTER_PORT"]) == ("3", "2", "29500")
    # ... and under Kubeflow's PET_* names, which torchrun reads as its defaults
    for name in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE"):
        assert env[f"PET_{name}"] == env[name], name
    assert not any(n.startswith("PET_") for n in _env(_all(mi300x(), "jax_lora", 2, 8).job))
    assert env["TUNEFLEET_REPORT_TOKEN"] == {"secretKeyRef": {"name": f"{m.name}-token", "key": "token"}}
    assert m.secret["stringData"] == {"token": "s3cret"}
    assert "s3cret" not in str(m.configmap) and "s3cret" not in str(m.job)


def test_kueue_mode_suspends_and_labels():
    m = _all(rtx4090(), "fsdp_qlora", 1, 1, kueue_queue="team-a")
    assert m.job["spec"]["suspend"] is True
    assert m.job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert "suspend" not in _all(rtx4090(), "fsdp_qlora", 1, 1).job["spec"]


def test_names_are_dns_labels_and_distinct_per_case_and_attempt():
    a, b = resource_name("ftjob-AbC"), resource_name("ftjob-abc")
    assert a != b and a == a.lower() and len(resource_name("ftjob-" + "Z" * 60, 999)) <= 50
    assert resource_name("ftjob-AbC", 2) != a


def test_trainer_pods_hold_no_cluster_credentials_and_no_privileges():
    m = _all(rtx4090(), "fsdp_qlora", 1, 1)
    pod = m.job["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    (container,) = pod["containers"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    # ... and what the trainers write (staged models, HF_HOME, library caches) is on emptyDirs
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/tmp"]] == {"name": "scratch", "emptyDir": {}}
    assert volumes[mounts["/home/tunefleet"]] == {"name": "home", "emptyDir": {}}
    assert "serviceAccountName" not in pod and "priorityClassName" not in pod
    assert "activeDeadlineSeconds" not in m.job["spec"]
    other = _all(rtx4090(), "fsdp_qlora", 1, 1).job
    other["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] = False
    assert pod["securityContext"]["runAsNonRoot"] is True  # each render gets its own copy


def test_pool_trainer_resources_scale_with_the_gpus_of_the_pod():
    pool = rtx4090(trainer_resources=TrainerResources(cpu_per_gpu=6, memory_gib_per_gpu=30.5,
                                                      cpu_limit_per_gpu=7.25, memory_limit_gib_per_gpu=40))
    assert pod_resources(pool, 2) == {
        "requests": {"cpu": "12", "memory": "61Gi", "nvidia.com/gpu": "2"},
        "limits": {"cpu": "14500m", "memory": "80Gi", "nvidia.com/gpu": "2"}}
    # a CPU pool's "GPU" is a trainer slot: no extended resource
    assert pod_resources(local_pool(4), 1) == {"requests": {"cpu": "4", "memory": "16Gi"},
                                               "limits": {"memory": "16Gi"}}


def test_a_limit_below_its_request_is_refused():
    with pytest.raises(ValueError, match="memory_limit_gib_per_gpu must be at least"):
        TrainerResources(memory_gib_per_gpu=32, memory_limit_gib_per_gpu=16)


def test_pod_failure_policy_follows_the_trainer_exit_codes():
    rules = _all(rtx4090(), "fsdp_qlora", 2, 2).job["spec"]["podFailurePolicy"]["rules"]
    by_code = {r["onExitCodes"]["values"][0]: r["action"] for r in rules if "onExitCodes" in r}
    assert by_code == {ExitCode.USER_ERROR: "FailJob", ExitCode.OUT_OF_MEMORY: "FailJob", ExitCode.PREEMPTED: "Count"}
    assert all(r["onExitCodes"]["containerName"] == "trainer" for r in rules if "onExitCodes" in r)
    # a disruption is matched first, whatever the trainer's exit code then was
    assert rules[0] == {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    # no rule lets the Job controller start a pod of its own: the executor runs the next attempt
    assert "Ignore" not in {r["action"] for r in rules}
    assert _all(rtx4090(), "fsdp_qlora", 2, 2).job["spec"]["backoffLimit"] == 0


def test_trainer_identity_priority_and_deadline_options():
    job = _all(rtx4090(), "fsdp_qlora", 1, 2, service_account="trainer", env_from_secret="keys",
               priority_class_name="batch", active_deadline_seconds=7200).job
    pod = job["spec"]["template"]["spec"]
    assert (pod["serviceAccountName"], pod["priorityClassName"]) == ("trainer", "batch")
    assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": "keys"}}]
    assert job["spec"]["activeDeadlineSeconds"] == 7200
    # the account's API token only when asked for, and never the namespace default's
    assert pod["automountServiceAccountToken"] is False
    mounted = _all(rtx4090(), "fsdp_qlora", 1, 2, service_account="trainer", automount_service_account_token=True)
    assert mounted.job["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    default = _all(rtx4090(), "fsdp_qlora", 1, 2, automount_service_account_token=True)
    assert default.job["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
