"""From Helm values to the trainer pod: the chart's settings reach every trainer Job.

The control plane's container environment is taken from the rendered chart, read by the
service's own settings class, turned into the executor's options by the function the
scheduler loop uses, and the trainer Job is rendered by the executor's renderer. A value
that the chart forgets to pass (or the loop forgets to wire) fails here.
"""

from __future__ import annotations

import kubernetes_validate
import pytest

from scheduling.pools import parse_pools
from tests.deploy.chart import (
    KUBE_VERSIONS,
    RELEASE,
    env_of,
    find,
    one,
    rendered_docs,
    resolved_env,
    settings_from,
)
from worker.executors.manifests import render_job
from worker.scheduler.loop import manifest_options, trainer_env

FULL = f"{RELEASE}-tunefleet"


def _trainer_job(values: str, component: str, monkeypatch) -> tuple[dict, object, tuple]:
    """The trainer Job the executor would create for a 1-node job on the first pool, from
    the settings the chart gives ``component``; with those settings."""
    docs = rendered_docs(values)
    container = one(docs, "Deployment", f"{FULL}-{component}")["spec"]["template"]["spec"][
        "containers"
    ][0]
    env = resolved_env(docs, container)
    settings = settings_from(env, monkeypatch)
    pools = parse_pools(one(docs, "ConfigMap", f"{FULL}-config")["data"]["pools.yaml"])
    job = render_job(job_id="ftjob-wiring", tenant="org-1", pool=pools[0], trainer=pools[0].trainers[0],
                     nodes=1, gpus_per_node=pools[0].gpus_per_node, opts=manifest_options(settings),
                     extra_env=trainer_env(settings, env))  # fmt: skip
    return job, settings, docs


@pytest.mark.parametrize("component", ["scheduler", "worker"])
def test_trainer_pods_get_the_credentials_identity_priority_and_deadline_of_the_values(
    component, monkeypatch
):
    job, settings, docs = _trainer_job("kueue", component, monkeypatch)
    pod = job["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    assert job["metadata"]["namespace"] == "ml-training"
    # static keys: every key of the operator's Secret in the training namespace
    assert trainer["envFrom"] == [{"secretRef": {"name": "trainer-s3-keys"}}]
    # IRSA: the chart's trainer ServiceAccount, in the namespace the pods run in
    assert pod["serviceAccountName"] == f"{FULL}-trainer"
    account = one(docs, "ServiceAccount", f"{FULL}-trainer")
    assert account["metadata"]["namespace"] == "ml-training"
    assert account["metadata"]["annotations"] == {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/tunefleet-trainer"
    }
    # IRSA projects its own token: no Kubernetes API token in the pod
    assert pod["automountServiceAccountToken"] is False
    assert account["automountServiceAccountToken"] is False
    assert pod["priorityClassName"] == "training-batch"
    assert job["spec"]["activeDeadlineSeconds"] == 86400
    # Kueue: the LocalQueue, and the WorkloadPriorityClass of each tunefleet priority
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-jobs"
    assert manifest_options(settings).kueue_priority_classes == (
        (25, "batch-low"), (50, "batch"), (75, "batch-high"))
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)


def test_static_keys_given_by_value_reach_trainers_through_a_secret_of_their_namespace(
    monkeypatch,
):
    job, _, docs = _trainer_job("two-pools-taints", "scheduler", monkeypatch)
    (trainer,) = job["spec"]["template"]["spec"]["containers"]
    (source,) = trainer["envFrom"]
    # a pod reads Secrets of its own namespace only: the chart writes one there
    (secret,) = [
        s for s in find(docs, "Secret") if s["metadata"]["name"] == source["secretRef"]["name"]
    ]
    assert secret["metadata"]["namespace"] == job["metadata"]["namespace"] == "tunefleet-training"
    assert secret["data"] == one(docs, "Secret", f"{FULL}-s3")["data"]
    assert set(secret["data"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    # boto3 in the trainer needs the bucket's region as much as the control plane does
    assert {"name": "AWS_DEFAULT_REGION", "value": "eu-west-1"} in trainer["env"]
    assert "serviceAccountName" not in job["spec"]["template"]["spec"]


def test_without_credentials_the_notes_say_what_to_set():
    from tests.deploy.chart import load_values, render

    docs = rendered_docs("external-s3")
    for component in ("scheduler", "worker"):
        container = one(docs, "Deployment", f"{FULL}-{component}")["spec"]["template"]["spec"]
        # its S3 Secret is in the release namespace, which trainer pods cannot read
        assert not {"TUNEFLEET_K8S_TRAINER_SECRET", "TUNEFLEET_K8S_TRAINER_SERVICE_ACCOUNT"} & set(
            env_of(container["containers"][0])
        )
    notes = next(t for p, t in render(load_values("external-s3")).items() if p.endswith("NOTES.txt"))
    assert "trainer pods get no object-store credentials" in notes
    assert "training.credentials.existingSecret" in notes
    notes = next(t for p, t in render(load_values("kueue")).items() if p.endswith("NOTES.txt"))
    assert "no object-store credentials" not in notes

