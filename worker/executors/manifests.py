"""Kubernetes manifests for one job: pure functions from (job, spec, pool, placement) to dicts.

Per job the executor creates, in order:

1. a ``ConfigMap`` ``<name>-spec`` holding ``spec.json`` (the trainer spec without the
   report token),
2. a ``Secret`` ``<name>-token`` holding the per-job report token,
3. for multi-node jobs a headless ``Service`` ``<name>`` (stable DNS for rank 0),
4. the ``batch/v1`` ``Job`` ``<name>`` (``Indexed`` for multi-node: one pod per node).

The ConfigMap, Secret and Service are owned by the Job (``ownerReferences``, set after
the Job exists and has a uid), so deleting the Job -- or its TTL after it finished --
cleans up everything. Every object carries the same labels, so the executor can list
and watch them by selector. Rendered dicts are validated against the Kubernetes schema
(``kubernetes_validate``) in the tests.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kube import kueue
from kube.labels import (
    COMPLETION_INDEX_ANNOTATION,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_MANAGED,
    LABEL_NAME,
    LABEL_POOL,
    LABEL_PRIORITY,
    LABEL_RUN,
    LABEL_TENANT,
)
from scheduling.pools import GIB, NodePool
from trainers.exit_codes import ExitCode

if TYPE_CHECKING:
    from trainers.spec import TrainerSpec

SPEC_MOUNT = "/etc/tunefleet/spec"
SPEC_FILE = f"{SPEC_MOUNT}/spec.json"
TERMINATION_LOG = "/dev/termination-log"
TOKEN_ENV = "TUNEFLEET_REPORT_TOKEN"
JAX_PORT = 8476
# Trainers run tenant data through third-party libraries: as a non-root user (the trainer
# images' USER 10001), without privilege escalation or Linux capabilities, under the
# runtime's default seccomp profile, on a read-only root filesystem. GPUs come through the
# device plugin, which needs none of these.
POD_SECURITY_CONTEXT: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
# What a trainer writes, each on an emptyDir: /tmp holds the staged base model and data
# (TUNEFLEET_CACHE_DIR), HF_HOME and checkpoints before upload; the home directory (the
# images' HOME and working directory) the libraries' caches (Triton, MIOpen, torch) and
# tracker run directories.
SCRATCH_MOUNT = "/tmp"
HOME_MOUNT = "/home/tunefleet"
TORCH_PORT = 29500


@dataclass(frozen=True)
class ManifestOptions:
    """Deployment-wide knobs (from settings / Helm values)."""

    namespace: str = "tunefleet-training"
    ttl_seconds_after_finished: int = 3600
    kueue_queue: str | None = None
    kueue_priority_classes: kueue.PriorityClasses = ()
    """tunefleet priority thresholds -> WorkloadPriorityClass (``kube.kueue``)."""
    shm_size: str = "16Gi"
    service_account: str | None = None
    image_pull_policy: str = "IfNotPresent"
    termination_grace_period_s: int = 300
    """Time a trainer gets after SIGTERM to write its checkpoint."""
    env_from_secret: str | None = None
    """A Secret in the training namespace whose keys become the trainer's environment
    (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for the artifact bucket); resolved by the
    kubelet, so the service account needs no access to it."""
    automount_service_account_token: bool = False
    """Mount ``service_account``'s API token (IRSA and workload identity project their own
    token and need none); never without a service account of our own."""
    priority_class_name: str | None = None
    active_deadline_seconds: int | None = None
    """The longest a trainer Job may run (Kubernetes then fails it: DeadlineExceeded)."""


def resource_name(job_id: str, attempt: int = 1) -> str:
    """A DNS-1123 name for one launch of a job (ids are mixed-case; a hash keeps them unique).

    The attempt number makes a relaunch (after preemption) independent of the previous
    launch's objects, which Kubernetes may still be deleting. At most 50 characters, so
    pod hostnames ``<name>-<index>`` stay valid DNS labels.
    """
    slug = re.sub(r"[^a-z0-9-]", "-", job_id.lower()).strip("-")[:30].strip("-")
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:8]
    return f"tf-{slug}-{digest}-{attempt}"


def labels(job_id: str, tenant: str, pool: str) -> dict[str, str]:
    return {
        LABEL_NAME: "tunefleet-trainer",
        LABEL_MANAGED: "tunefleet",
        LABEL_JOB: job_id,
        LABEL_POOL: pool,
        LABEL_TENANT: tenant,
    }


def _meta(name: str, namespace: str, lbls: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": dict(lbls)}


def render_configmap(
    name: str, spec_json: dict[str, Any], lbls: dict[str, str], opts: ManifestOptions
) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{name}-spec", opts.namespace, lbls),
        "data": {"spec.json": json.dumps(spec_json, indent=2, sort_keys=True)},
    }


def render_secret(name: str, token: str, lbls: dict[str, str], opts: ManifestOptions) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": _meta(f"{name}-token", opts.namespace, lbls),
        "stringData": {"token": token},
    }


def render_service(name: str, lbls: dict[str, str], opts: ManifestOptions) -> dict[str, Any]:
    """Headless Service: pods of an Indexed Job get ``<name>-<index>.<name>`` DNS names."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(name, opts.namespace, lbls),
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_JOB: lbls[LABEL_JOB], LABEL_MANAGED: "tunefleet"},
            # rank 0 must be reachable before every pod is Ready (they rendezvous first)
            "publishNotReadyAddresses": True,
            "ports": [{"name": "jax", "port": JAX_PORT}, {"name": "torch", "port": TORCH_PORT}],
        },
    }


def _distributed_env(
    name: str, trainer: str, nodes: int, gpus_per_node: int, opts: ManifestOptions
) -> list[dict[str, Any]]:
    index = {"valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}}
    rank0 = f"{name}-0.{name}.{opts.namespace}.svc"
    if nodes == 1:
        env = [{"name": "NNODES", "value": "1"}, {"name": "NODE_RANK", "value": "0"}]
        if trainer == "fsdp_qlora":
            env.append({"name": "NPROC_PER_NODE", "value": str(gpus_per_node)})
            env += _pet_names(env)
        return env
    if trainer == "jax_lora":
        return [
            {"name": "JAX_COORDINATOR_ADDRESS", "value": f"{rank0}:{JAX_PORT}"},
            {"name": "JAX_NUM_PROCESSES", "value": str(nodes)},
            {"name": "JAX_PROCESS_ID", **index},
        ]
    env = [
        {"name": "MASTER_ADDR", "value": rank0},
        {"name": "MASTER_PORT", "value": str(TORCH_PORT)},
        {"name": "NNODES", "value": str(nodes)},
        {"name": "NODE_RANK", **index},
        {"name": "NPROC_PER_NODE", "value": str(gpus_per_node)},
    ]
    return env + _pet_names(env)


def _pet_names(env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same rendezvous under Kubeflow's ``PET_*`` names, which torchrun reads as its
    defaults (``PET_NNODES`` for ``--nnodes``...): an image that starts with torchrun, or
    tooling written for Kubeflow's PyTorchJob, finds them where it looks."""
    return [{**copy.deepcopy(e), "name": f"PET_{e['name']}"} for e in env]


def render_job(*, job_id: str, tenant: str, pool: NodePool, trainer: str, nodes: int, gpus_per_node: int,
               opts: ManifestOptions, command: list[str] | None = None, image: str | None = None,
               extra_env: dict[str, str] | None = None, attempt: int = 1) -> dict[str, Any]:
    """The batch/v1 Job running the trainer: one pod per node, all GPUs of the gang."""
    name = resource_name(job_id, attempt)
    lbls = labels(job_id, tenant, pool.name)
    job_labels = dict(lbls)
    if opts.kueue_queue:
        job_labels[kueue.QUEUE_LABEL] = opts.kueue_queue
    env: list[dict[str, Any]] = [
        {"name": "TUNEFLEET_JOB_ID", "value": job_id},
        {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": f"{name}-token", "key": "token"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *_distributed_env(name, trainer, nodes, gpus_per_node, opts),
        *({"name": k, "value": v} for k, v in sorted((extra_env or {}).items())),
    ]
    container = {
        "name": "trainer",
        "image": image or pool.trainer_image or "tunefleet-trainer:latest",
        "imagePullPolicy": opts.image_pull_policy,
        "command": command or ["python", "-m", "trainers", "--spec", SPEC_FILE],
        "env": env,
        **({"envFrom": [{"secretRef": {"name": opts.env_from_secret}}]} if opts.env_from_secret else {}),
        "resources": pod_resources(pool, gpus_per_node),
        "volumeMounts": [
            {"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "scratch", "mountPath": SCRATCH_MOUNT},
            {"name": "home", "mountPath": HOME_MOUNT},
        ],
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [
            {"name": "spec", "configMap": {"name": f"{name}-spec"}},
            # NCCL/RCCL and data loader workers need more than the default 64 MiB /dev/shm.
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}},
            {"name": "scratch", "emptyDir": {}},
            {"name": "home", "emptyDir": {}},
        ],
        "terminationGracePeriodSeconds": opts.termination_grace_period_s,
        # The trainer talks to the API with its job token only: no Kubernetes credentials,
        # unless the operator's trainer service account is given and asked to mount them.
        "automountServiceAccountToken": bool(opts.service_account and opts.automount_service_account_token),
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
    }
    if pool.node_selector:
        pod_spec["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod_spec["tolerations"] = [t.model_dump(exclude_none=True) for t in pool.tolerations]
    if opts.service_account:
        pod_spec["serviceAccountName"] = opts.service_account
    if opts.priority_class_name:
        pod_spec["priorityClassName"] = opts.priority_class_name
    if nodes > 1:
        pod_spec["subdomain"] = name  # with the headless Service: <name>-<i>.<name> resolves
    spec: dict[str, Any] = {
        # The executor decides about retries (exit codes, pod failures): no blind retries.
        "backoffLimit": 0,
        "podFailurePolicy": pod_failure_policy(),
        "completions": nodes,
        "parallelism": nodes,
        "ttlSecondsAfterFinished": opts.ttl_seconds_after_finished,
        "template": {"metadata": {"labels": dict(lbls)}, "spec": pod_spec},
    }
    if nodes > 1:
        spec["completionMode"] = "Indexed"
    if opts.active_deadline_seconds:
        spec["activeDeadlineSeconds"] = opts.active_deadline_seconds
    if opts.kueue_queue:
        spec["suspend"] = True  # Kueue admits (unsuspends) it when the quota allows
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _meta(name, opts.namespace, job_labels), "spec": spec}


def pod_resources(pool: NodePool, gpus: int) -> dict[str, Any]:
    """Requests and limits of a trainer container holding ``gpus`` of ``pool``'s GPUs.

    CPU and memory scale with the GPUs (``pool.trainer_resources``); a CPU pool's "GPU" is
    a trainer slot. Memory is limited at its request unless the pool allows more, so an
    out-of-memory trainer is killed alone (OOMKilled) instead of its node evicting pods.
    """
    per = pool.trainer_resources
    share = max(gpus, 1)
    requests = {"cpu": _cpu(per.cpu_per_gpu * share), "memory": _memory(per.memory_gib_per_gpu * share)}
    limits = {"memory": _memory((per.memory_limit_gib_per_gpu or per.memory_gib_per_gpu) * share)}
    if per.cpu_limit_per_gpu is not None:
        limits["cpu"] = _cpu(per.cpu_limit_per_gpu * share)
    if pool.resource_name and gpus:
        requests[pool.resource_name] = limits[pool.resource_name] = str(gpus)
    return {"requests": requests, "limits": limits}


def _cpu(cores: float) -> str:
    millis = round(cores * 1000)
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def _memory(gib: float) -> str:
    mib = round(gib * GIB / 2**20)
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def pod_failure_policy() -> dict[str, Any]:
    """How the Job controller treats a failed trainer pod (the trainer's exit codes).

    Every failed pod ends the Job (``backoffLimit: 0``): the executor alone decides about
    another run (``pod_outcomes``), and it starts one as a new Job with a new attempt and
    token. A disruption (drain, eviction, a lost node) and a trainer that checkpointed on
    SIGTERM are not the job's fault -- the executor requeues those without counting a
    restart -- but they are ``Count``, not ``Ignore``: an ignored failure makes the Job
    controller start a replacement pod of the old attempt in the same Job, which then
    writes the job's checkpoints in the bucket next to the executor's new run until its
    Job is deleted. A user error or an out-of-memory exit is ``FailJob``, so the Job's
    Failed condition names the exit code. Either way the other pods of a multi-node gang
    stop at once instead of waiting in a collective.
    """
    def on_exit(action: str, code: ExitCode) -> dict[str, Any]:
        return {"action": action, "onExitCodes": {"containerName": "trainer", "operator": "In",
                                                  "values": [int(code)]}}
    return {"rules": [
        {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        on_exit("FailJob", ExitCode.USER_ERROR),
        on_exit("FailJob", ExitCode.OUT_OF_MEMORY),
        on_exit("Count", ExitCode.PREEMPTED),
    ]}


def owner_reference(job_obj: dict[str, Any]) -> dict[str, Any]:
    """An ownerReference to the created Job (needs its uid)."""
    return {"apiVersion": "batch/v1", "kind": "Job", "name": job_obj["metadata"]["name"],
            "uid": job_obj["metadata"]["uid"], "controller": False, "blockOwnerDeletion": False}


@dataclass(frozen=True)
class JobManifests:
    name: str
    configmap: dict[str, Any]
    secret: dict[str, Any]
    service: dict[str, Any] | None
    job: dict[str, Any]

    def all(self) -> list[dict[str, Any]]:
        return [d for d in (self.configmap, self.secret, self.service, self.job) if d is not None]


def render_all(*, job_id: str, tenant: str, pool: NodePool, trainer: str, nodes: int, gpus_per_node: int,
               spec_json: dict[str, Any], token: str, opts: ManifestOptions,
               command: list[str] | None = None, extra_env: dict[str, str] | None = None,
               attempt: int = 1) -> JobManifests:
    """Every object of one job. ``spec_json`` must not contain the token (it goes in the Secret)."""
    name = resource_name(job_id, attempt)
    lbls = labels(job_id, tenant, pool.name)
    return JobManifests(
        name=name,
        configmap=render_configmap(name, spec_json, lbls, opts),
        secret=render_secret(name, token, lbls, opts),
        service=render_service(name, lbls, opts) if nodes > 1 else None,
        job=render_job(job_id=job_id, tenant=tenant, pool=pool, trainer=trainer, nodes=nodes,
                       gpus_per_node=gpus_per_node, opts=opts, command=command, extra_env=extra_env,
                       attempt=attempt),
    )


def launch_manifests(spec: TrainerSpec, *, tenant: str, priority: int, pool: NodePool, trainer: str, nodes: int,
                     gpus_per_node: int, opts: ManifestOptions, attempt: int, run: int | None,
                     command: list[str] | None = None, extra_env: dict[str, str] | None = None) -> JobManifests:
    """Every object of one launch of a job, exactly as the executor creates them.

    The spec's report token moves to the Secret; the spec names the pod's termination
    log; every object and pod carries the job's priority, the launch number (``attempt``)
    and the database's run attempt (``run``; None: unknown), so that each change observed
    on this launch names its run and an old launch's exit never moves a newer run. In
    Kueue mode the Job also names the WorkloadPriorityClass its priority maps to.
    """
    spec_json = spec.model_dump(mode="json")
    spec_json["report"]["token"] = None
    spec_json["termination_log"] = TERMINATION_LOG
    m = render_all(job_id=spec.job_id, tenant=tenant, pool=pool, trainer=trainer, nodes=nodes,
                   gpus_per_node=gpus_per_node, spec_json=spec_json, token=spec.report.token or "", opts=opts,
                   command=command, extra_env=extra_env, attempt=attempt)
    launch = {LABEL_PRIORITY: str(priority), LABEL_ATTEMPT: str(attempt)}
    if run is not None:
        launch[LABEL_RUN] = str(run)
    for labelled in (*m.all(), m.job["spec"]["template"]):
        labelled["metadata"]["labels"].update(launch)
    priority_class = kueue.priority_class_for(priority, opts.kueue_priority_classes) if opts.kueue_queue else None
    if priority_class:
        m.job["metadata"]["labels"][kueue.PRIORITY_CLASS_LABEL] = priority_class
    return m
