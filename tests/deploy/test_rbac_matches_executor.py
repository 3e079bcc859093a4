"""The chart's RBAC grants exactly what the service's Kubernetes client calls need.

Two independent derivations, neither written by hand, are compared with the rules in
helm/tunefleet/templates/rbac.yaml:

- static: every client method the service code references, mapped to its HTTP request by
  the client's own generated code (tests/deploy/k8s_calls.py) — covers every code path;
- dynamic: the real executor runs a two-node job's life (informers, launch, logs, stop)
  against the fake API server of tests/k8s, which records every request it serves.

A new client call without a rule fails here (it would fail with 403 in a cluster), and so
does a rule that no code uses (least privilege).
"""

from __future__ import annotations

from tests.deploy.chart import REPO_ROOT, one, rendered_docs
from tests.deploy.k8s_calls import (
    Permission,
    permission_for,
    permissions_in_source,
    permissions_in_tree,
)

FULL = "tf-tunefleet"
SERVICE_CODE = (REPO_ROOT / "worker", REPO_ROOT / "api", REPO_ROOT / "kube")
EXECUTOR = REPO_ROOT / "worker" / "executors" / "kubernetes.py"


def _granted(rules: list[dict], namespaced: bool) -> set[Permission]:
    return {
        Permission(group, resource, verb, namespaced)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def granted_by_chart(values: str = "default") -> set[Permission]:
    docs = rendered_docs(values)
    role = one(docs, "Role", f"{FULL}-executor")
    cluster_role = one(docs, "ClusterRole", f"{FULL}-tunefleet-nodes")
    return _granted(role["rules"], True) | _granted(cluster_role["rules"], False)


def test_the_derivation_maps_requests_like_the_api_server():
    # Independent facts from the Kubernetes authorization docs (request -> verb/resource).
    assert permission_for("GET", "/api/v1/namespaces/{namespace}/pods/{name}/log") == Permission(
        "", "pods/log", "get", True
    )
    assert permission_for("GET", "/apis/batch/v1/namespaces/{namespace}/jobs") == Permission(
        "batch", "jobs", "list", True
    )
    assert (
        permission_for("GET", "/apis/batch/v1/namespaces/{namespace}/jobs", watch=True).verb
        == "watch"
    )
    assert (
        permission_for("DELETE", "/api/v1/namespaces/{namespace}/secrets").verb
        == "deletecollection"
    )
    assert permission_for(
        "PATCH", "/apis/batch/v1/namespaces/{namespace}/jobs/{name}/status"
    ) == Permission("batch", "jobs/status", "patch", True)
    assert permission_for("GET", "/api/v1/nodes/{name}") == Permission("", "nodes", "get", False)


def test_the_derivation_reads_calls_references_and_watches():
    source = """
from kubernetes import client, watch
core, batch = client.CoreV1Api(), client.BatchV1Api()
batch.create_namespaced_job("ns", body)
for event in watch.Watch().stream(core.list_namespaced_pod, "ns", label_selector="a=b"):
    pass
core.read_namespaced_pod_log("p", "ns")
core.list_node()
batch.list_namespaced_job("ns", watch=True)
getter = core.read_namespaced_config_map
s3.list_objects_v2(Bucket="b")          # not a Kubernetes call
"""
    assert permissions_in_source(source) == {
        Permission("batch", "jobs", "create", True),
        Permission("", "pods", "watch", True),
        Permission("", "pods/log", "get", True),
        Permission("", "nodes", "list", False),
        Permission("batch", "jobs", "watch", True),
        Permission("", "configmaps", "get", True),
    }


def test_the_derivation_follows_an_informer_that_streams_a_stored_list_function():
    source = """
from kubernetes import client, watch
class Informer:
    def __init__(self, list_fn):
        self.list_fn = list_fn
    def run(self):
        self.list_fn("ns")                      # relist
        for event in watch.Watch().stream(self.list_fn, "ns"):
            pass
core = client.CoreV1Api()
pods = Informer(core.list_namespaced_pod)
create = core.create_namespaced_secret          # stored, called later through the name
"""
    assert permissions_in_source(source) == {
        Permission("", "pods", "list", True),
        Permission("", "pods", "watch", True),
        Permission("", "secrets", "create", True),
    }


def test_rbac_equals_the_calls_the_service_makes():
    assert EXECUTOR.is_file(), "the Kubernetes executor (worker/executors/kubernetes.py) is missing"
    needed = permissions_in_tree(*SERVICE_CODE)
    granted = granted_by_chart()
    missing = {p: files for p, files in needed.items() if p not in granted}
    unused = granted - set(needed)
    assert not missing, f"calls without an RBAC rule (403 in a cluster): {missing}"
    assert not unused, f"RBAC rules that no code uses (not least privilege): {sorted(unused)}"


def test_the_api_role_equals_what_serving_pod_logs_needs():
    """The API reads pod logs with ``kube.pod_logs.read_pod_log`` (through
    ``api.outputs.logs.kubernetes_log``) and makes no other Kubernetes call."""
    import inspect
    import textwrap

    from kube.pod_logs import read_pod_log

    needed = permissions_in_source(textwrap.dedent(inspect.getsource(read_pod_log)))
    assert needed == {Permission("", "pods", "list", True), Permission("", "pods/log", "get", True)}
    api_code = permissions_in_tree(REPO_ROOT / "api")
    assert not api_code, f"the API makes Kubernetes calls of its own: {api_code}"
    for values in ("default", "kueue", "two-pools-taints"):
        docs = rendered_docs(values)
        role = one(docs, "Role", f"{FULL}-api-logs")
        # the training namespace, where the executor's Role is
        assert role["metadata"]["namespace"] == one(docs, "Role", f"{FULL}-executor")["metadata"]["namespace"]
        assert _granted(role["rules"], True) == needed, values


def test_rbac_does_not_depend_on_values():
    granted = granted_by_chart()
    for values in ("kueue", "external-s3", "two-pools-taints"):
        assert granted_by_chart(values) == granted, values


def test_the_executor_against_the_fake_api_server_needs_exactly_these_permissions(tmp_path):
    """Run the real executor through a job's life against the fake API server (which speaks
    the REST + watch protocol and records every request) and compare what it really asked
    for with the chart's RBAC and with the static derivation."""
    import sys
    from dataclasses import dataclass

    import yaml

    from scheduling.placement import Placement
    from scheduling.pools import parse_pools
    from tests.deploy.chart import CHART_DIR
    from tests.k8s.fake_apiserver import FakeApiServer, two_pool_cluster
    from trainers.spec import TrainerSpec
    from worker.executors.base import ObservedKind, StopReason
    from worker.executors.kubernetes import KubernetesExecutor
    from worker.executors.manifests import SPEC_FILE, ManifestOptions

    @dataclass
    class JobRow:
        id: str
        tenant_id: str = "org-1"
        priority: int = 50

    namespace = "tunefleet-training"
    job = JobRow("ftjob-Rbac")
    spec = TrainerSpec.model_validate({
        "job_id": job.id, "trainer": "jax_lora", "model": {"path": "/models/tiny"},
        "data": {"train_file": "/data/train.jsonl", "format": "chat"},
        "hyperparameters": {"n_epochs": 1, "batch_size": 2, "micro_batch_size": 1, "learning_rate": 1e-4},
        "output_dir": "/out", "checkpoint": {"dir": "/ckpt"},
        "report": {"url": "http://api/internal", "token": "tok"},
    })  # fmt: skip
    # The chart's own default pools (two MI300X nodes of 8 GPUs in the fake cluster).
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text(encoding="utf-8"))
    pools = parse_pools(yaml.safe_dump({"pools": values["pools"]}))
    placement = Placement(
        "fit", pool="mi300x", gpus=16, nodes=(("mi300x-0", 8), ("mi300x-1", 8)), trainer="jax_lora"
    )
    fake_trainer = str(REPO_ROOT / "tests" / "k8s" / "fake_trainer.py")

    with FakeApiServer(tmp_path / "k8s") as api:
        two_pool_cluster(api, namespace=namespace)
        ex = KubernetesExecutor(
            api.api_client(), pools, options=ManifestOptions(namespace=namespace, termination_grace_period_s=5),
            command=[sys.executable, fake_trainer, "--spec", SPEC_FILE],
            extra_env={"FAKE_TRAINER_MODE": "succeed"}, watch_timeout_s=1,
        )  # fmt: skip
        ex.start()  # the background informers list and watch, as in the service
        try:
            ex.snapshot()  # nodes
            # Two nodes: the spec ConfigMap, token Secret, headless Service and the Job.
            ex.launch(job, spec, placement)
            seen = []
            api.wait_for(
                lambda: (
                    seen.extend(ex.reconcile()) or ObservedKind.SUCCEEDED in [c.kind for c in seen]
                )
            )
            assert ex.logs(job.id)
            ex.stop(job, StopReason.CANCEL)
        finally:
            ex.close()
        recorded = {
            Permission("batch" if resource == "jobs" else "", resource, verb, resource != "nodes")
            for verb, resource in api.cluster.requests
        }
    granted = granted_by_chart()
    assert recorded <= granted, (
        f"requests the chart's RBAC would refuse: {sorted(recorded - granted)}"
    )
    assert recorded <= set(permissions_in_tree(*SERVICE_CODE)), (
        "the static derivation missed a request"
    )
    assert recorded == granted, f"granted but never requested: {sorted(granted - recorded)}"
