"""The Helm chart: strict lint, offline render, schema validation of every manifest.

Rendering uses Helm's own Go SDK (helm-python-sdk) and validation the Kubernetes OpenAPI
schemas for 1.30 and 1.33 (kubernetes-validate, strict: unknown fields fail). No cluster
runs here, so admission webhooks, CRD installation and scheduling are not exercised.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from jsonschema import Draft202012Validator

from tests.deploy.chart import (
    CHART_DIR,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    VALUES_FILES,
    env_of,
    find,
    load_values,
    one,
    pod_specs,
    render,
    rendered_docs,
    resolved_env,
    settings_from,
)

FULL = f"{RELEASE}-tunefleet"
VALUE_SETS = list(VALUES_FILES)
# Kinds that are not part of Kubernetes itself (their CRDs come with the add-on).
CRD_KINDS = {("kueue.x-k8s.io/v1beta2", "LocalQueue")}


def test_the_three_required_values_files_exist():
    assert {"kueue", "external-s3", "two-pools-taints"} <= set(VALUES_FILES)


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_strict_is_clean(name, kube_version):
    report = helm.lint(CHART_DIR, load_values(name), strict=True, kube_version=f"v{kube_version}.0")
    # Severity 2 = warning, 3 = error; strict lint fails on both. Info (1) is advice only.
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_manifest_validates_against_kubernetes_schemas(name):
    docs = rendered_docs(name)
    assert len(docs) >= 15
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_broken_manifest():
    # The check above has teeth: a misspelled field in a rendered Deployment fails.
    deployment = copy.deepcopy(one(rendered_docs("default"), "Deployment", f"{FULL}-api"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.33", strict=True)


def test_kueue_local_queue_is_kueues_served_storage_version():
    """Against the spec schema of the version Kueue's CRD stores and serves
    (``kueue/localqueue_spec.json``, extracted by ``kueue/extract.py``): current Kueue
    releases no longer serve v1beta1."""
    crd = json.loads((Path(__file__).parent / "kueue" / "localqueue_spec.json").read_text(encoding="utf-8"))
    (queue,) = find(rendered_docs("kueue"), "LocalQueue")
    assert queue["apiVersion"] == crd["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    assert queue["metadata"] == queue["metadata"] | {"name": "gpu-jobs", "namespace": "ml-training"}
    assert queue["spec"] == {"clusterQueue": "team-a"}
    assert list(Draft202012Validator(crd["spec"]).iter_errors(queue["spec"])) == []
    assert set(queue["spec"]) <= set(crd["spec"]["properties"])


def test_only_kueue_mode_renders_custom_resources():
    for name in VALUE_SETS:
        kinds = {(d["apiVersion"], d["kind"]) for d in rendered_docs(name)}
        expected = CRD_KINDS if name == "kueue" else set()
        assert kinds & CRD_KINDS == expected, name


@pytest.mark.parametrize(
    ("bad", "mentions"),
    [
        ({"replicaCount": 3}, "replicaCount"),  # unknown top-level key
        ({"api": {"replica": 3}}, "replica"),  # typo of api.replicas
        ({"database": {"url": "mysql://u:p@db/tf"}}, "url"),
        ({"broker": {"url": "amqp://rabbit"}}, "url"),
        ({"auth": {"secretKey": "short"}}, "secretKey"),
        ({"artifacts": {"url": "/var/lib/tunefleet/artifacts"}}, "url"),
        ({"pools": []}, "pools"),
        (
            {
                "pools": [
                    {
                        "name": "x",
                        "accelerator": "nvidia-a100",
                        "gpus_per_node": 8,
                        "peak_tflops": 312,
                        "trainer": "deepspeed",
                    }
                ]
            },
            "trainer",
        ),
        ({"podSecurityContext": {"runAsNonRoot": False}}, "runAsNonRoot"),
        ({"image": {"digest": "latest"}}, "digest"),
        ({"api": {"replicas": 0}}, "replicas"),
        ({"kueue": {"localQueue": "Not A Name"}}, "localQueue"),
        ({"baseModels": [{"id": "m", "path": "s3://b/m", "params": 8}]}, "params"),
    ],
)
def test_values_that_break_the_schema_are_rejected(bad, mentions):
    with pytest.raises(helm.HelmError) as excinfo:
        render(bad)
    assert "schema" in str(excinfo.value).lower() and mentions in str(excinfo.value)


def test_default_values_satisfy_the_schema():
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema({})
        for name in VALUE_SETS:
            chart.validate_schema(load_values(name))


# ---- what the manifests say --------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_pools_configmap_is_accepted_by_the_service_parser(name):
    from scheduling.pools import parse_pools

    config = one(rendered_docs(name), "ConfigMap", f"{FULL}-config")
    pools = parse_pools(config["data"]["pools.yaml"], source="ConfigMap pools.yaml")
    values_pools = (
        load_values(name).get("pools")
        or load_values("default").get("pools")
        or (yaml.safe_load((CHART_DIR / "values.yaml").read_text())["pools"])
    )
    assert [p.name for p in pools] == [p["name"] for p in values_pools]
    for pool, given in zip(pools, values_pools):
        assert dict(pool.node_selector) == given["node_selector"]
        assert [t.model_dump(exclude_none=True) for t in pool.tolerations] == given["tolerations"]


def test_two_pool_values_keep_taints_and_selectors():
    from scheduling.pools import parse_pools

    config = one(rendered_docs("two-pools-taints"), "ConfigMap", f"{FULL}-config")
    pools = {p.name: p for p in parse_pools(config["data"]["pools.yaml"])}
    assert pools["mi300x-east"].resource_name == "amd.com/gpu"
    assert pools["mi300x-east"].trainers == ("jax_lora",)
    assert pools["rtx3090"].resource_name == "nvidia.com/gpu"
    assert pools["rtx3090"].trainers == ("fsdp_qlora",)
    assert {t.effect for t in pools["rtx3090"].tolerations} == {"NoSchedule", "NoExecute"}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_control_plane_env_names_are_settings(name):
    from control.settings import Settings

    fields = {f"TUNEFLEET_{f.upper()}" for f in Settings.model_fields}
    for obj_name, spec in pod_specs(rendered_docs(name)):
        for container in spec["containers"]:
            for env in env_of(container):
                if env.startswith("TUNEFLEET_"):
                    assert env in fields, f"{obj_name}: {env} is not a Settings field"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_secret_reference_resolves(name):
    """Each non-optional secretKeyRef names a key of a rendered Secret or an existing Secret."""
    docs = rendered_docs(name)
    values = load_values(name)
    rendered = {
        s["metadata"]["name"]: set((s.get("data") or {}).keys()) for s in find(docs, "Secret")
    }
    existing = {
        values.get("database", {}).get("existingSecret"),
        values.get("broker", {}).get("existingSecret"),
        values.get("auth", {}).get("existingSecret"),
        values.get("artifacts", {}).get("s3", {}).get("existingSecret"),
    } - {None, ""}
    for obj_name, spec in pod_specs(docs):
        for container in spec["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if not ref or ref.get("optional"):
                    continue
                if ref["name"] in existing:
                    continue
                assert ref["key"] in rendered.get(ref["name"], set()), (obj_name, env["name"], ref)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_pods_run_as_non_root_with_read_only_root_filesystem(name):
    for obj_name, spec in pod_specs(rendered_docs(name)):
        assert spec["securityContext"]["runAsNonRoot"] is True, obj_name
        assert spec["securityContext"]["runAsUser"] != 0, obj_name
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes["tmp"], obj_name
        for container in spec["containers"]:
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True, obj_name
            assert ctx["allowPrivilegeEscalation"] is False, obj_name
            assert ctx["capabilities"]["drop"] == ["ALL"], obj_name
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts["/tmp"] == "tmp", obj_name
            assert "memory" in container["resources"]["limits"], obj_name


def test_api_probes_and_the_api_token_reads_pod_logs_only():
    docs = rendered_docs("default")
    api = one(docs, "Deployment", f"{FULL}-api")["spec"]["template"]["spec"]
    (container,) = api["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The API's own ServiceAccount, whose token may only read trainer pod logs
    # (tests/deploy/test_rbac_matches_executor.py derives those rules from the code).
    assert api["automountServiceAccountToken"] is True
    assert api["serviceAccountName"] == f"{FULL}-api"
    api_bindings = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
                    and any(s["name"] == f"{FULL}-api" for s in d["subjects"])]
    assert [(b["kind"], b["roleRef"]["name"]) for b in api_bindings] == [("RoleBinding", f"{FULL}-api-logs")]
    # Only the worker and the scheduler use the ServiceAccount bound to the executor Role.
    for name in ("worker", "scheduler"):
        spec = one(docs, "Deployment", f"{FULL}-{name}")["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == FULL
    binding = one(docs, "RoleBinding", f"{FULL}-executor")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULL, "namespace": NAMESPACE}]


def test_scheduler_is_a_single_replica_replaced_not_rolled():
    spec = one(rendered_docs("two-pools-taints"), "Deployment", f"{FULL}-scheduler")["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}


def test_migrations_run_as_a_pre_install_and_pre_upgrade_hook():
    docs = rendered_docs("default")
    job = one(docs, "Job", f"{FULL}-migrations")
    hooks = job["metadata"]["annotations"]
    assert hooks["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "tunefleet",
        "db",
        "upgrade",
    ]
    # Hooks run before ordinary resources exist: the database URL comes from a hook Secret
    # created earlier (lower weight), not from the release's Secret.
    secret = one(docs, "Secret", f"{FULL}-migrations")
    assert secret["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert int(secret["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        hooks["helm.sh/hook-weight"]
    )
    ref = env_of(job["spec"]["template"]["spec"]["containers"][0])["TUNEFLEET_DATABASE_URL"]
    assert ref["valueFrom"]["secretKeyRef"]["name"] == f"{FULL}-migrations"
    # With an existing Secret the hook uses it directly and renders no copy.
    docs = rendered_docs("external-s3")
    assert find(docs, "Secret", f"{FULL}-migrations") == []
    job = one(docs, "Job", f"{FULL}-migrations")
    ref = env_of(job["spec"]["template"]["spec"]["containers"][0])["TUNEFLEET_DATABASE_URL"]
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "tunefleet-db", "key": "url"}


def test_secret_values_are_stored_and_the_secret_key_is_generated():
    values = load_values("two-pools-taints")
    docs = rendered_docs("two-pools-taints")
    data = {k: base64.b64decode(v).decode() for k, v in one(docs, "Secret", FULL)["data"].items()}
    assert data["database-url"] == values["database"]["url"]
    assert data["broker-url"] == values["broker"]["url"]
    assert len(data["secret-key"]) == 64 and data["secret-key"].isalnum()
    assert len(data["metrics-token"]) == 48 and data["metrics-token"].isalnum()  # production needs it
    s3 = one(docs, "Secret", f"{FULL}-s3")["data"]
    assert (
        base64.b64decode(s3["AWS_ACCESS_KEY_ID"]).decode()
        == values["artifacts"]["s3"]["accessKeyId"]
    )


def test_external_s3_and_existing_secrets():
    docs = rendered_docs("external-s3")
    worker = one(docs, "Deployment", f"{FULL}-worker")["spec"]["template"]["spec"]["containers"][0]
    env = env_of(worker)
    assert env["TUNEFLEET_ARTIFACT_URL"]["value"] == "s3://ml-artifacts/tunefleet/prod"
    assert env["TUNEFLEET_S3_ENDPOINT_URL"]["value"] == "https://s3.storage.internal:9000"
    assert (
        env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "tunefleet-s3-credentials"
    )
    assert env["TUNEFLEET_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "tunefleet-db",
        "key": "url",
    }
    assert env["TUNEFLEET_BROKER_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "tunefleet-redis",
        "key": "url",
    }
    assert env["TUNEFLEET_PUBLIC_URL"]["value"] == "https://tunefleet.internal.example.com"
    assert worker["image"].endswith(
        "@sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"
    )
    # Only the auth keys given by value are in the chart's Secret.
    assert set(one(docs, "Secret", FULL)["data"]) == {"secret-key", "metrics-token", "admin-api-key"}
    ingress = one(docs, "Ingress", f"{FULL}-api")
    assert ingress["spec"]["tls"][0]["secretName"] == "tunefleet-tls"


def test_default_public_url_is_the_in_cluster_api_service():
    docs = rendered_docs("default")
    env = env_of(
        one(docs, "Deployment", f"{FULL}-worker")["spec"]["template"]["spec"]["containers"][0]
    )
    service = one(docs, "Service", f"{FULL}-api")
    port = service["spec"]["ports"][0]["port"]
    assert env["TUNEFLEET_PUBLIC_URL"]["value"] == f"http://{FULL}-api.{NAMESPACE}.svc:{port}"
    assert env["TUNEFLEET_EXECUTOR"]["value"] == "kubernetes"
    assert env["TUNEFLEET_K8S_NAMESPACE"]["value"] == "tunefleet-training"
    assert "TUNEFLEET_KUEUE_QUEUE" not in env


def test_kueue_mode_wires_the_queue_and_the_training_namespace():
    docs = rendered_docs("kueue")
    for name in ("worker", "scheduler", "api"):
        container = one(docs, "Deployment", f"{FULL}-{name}")["spec"]["template"]["spec"][
            "containers"
        ][0]
        env = env_of(container)
        assert env["TUNEFLEET_KUEUE_QUEUE"]["value"] == "gpu-jobs"
        assert env["TUNEFLEET_K8S_NAMESPACE"]["value"] == "ml-training"
    assert one(docs, "Role", f"{FULL}-executor")["metadata"]["namespace"] == "ml-training"
    assert (
        one(docs, "Namespace", "ml-training")["metadata"]["annotations"]["helm.sh/resource-policy"]
        == "keep"
    )
    trainers = one(docs, "NetworkPolicy", f"{FULL}-trainers")
    assert trainers["metadata"]["namespace"] == "ml-training"


def test_config_change_rolls_the_pods():
    base = load_values("kueue")
    changed = copy.deepcopy(base) | {"pools": load_values("two-pools-taints")["pools"]}

    def checksum(values):
        text = render(values)["tunefleet/templates/worker.yaml"]
        deployment = next(yaml.safe_load_all(text))
        return deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert checksum(base) != checksum(changed)


def test_pdbs_and_network_policies():
    docs = rendered_docs("external-s3")
    assert {p["metadata"]["name"] for p in find(docs, "PodDisruptionBudget")} == {
        f"{FULL}-api",
        f"{FULL}-worker",
    }
    api_policy = one(docs, "NetworkPolicy", f"{FULL}-api")
    sources = api_policy["spec"]["ingress"][0]["from"]
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}
    } in sources
    # Training pods report back to the API: their namespace is always allowed in.
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "tunefleet-training"}}
    } in sources
    control = one(docs, "NetworkPolicy", f"{FULL}-control-plane")
    # Workers and the scheduler let in their metrics port (Prometheus) and nothing else.
    assert control["spec"]["policyTypes"] == ["Ingress"]
    assert control["spec"]["ingress"] == [{"ports": [{"port": "metrics", "protocol": "TCP"}]}]


def test_trainer_pods_connect_out_only_to_the_api_dns_their_gang_and_the_store():
    docs = rendered_docs("external-s3")
    trainers = one(docs, "NetworkPolicy", f"{FULL}-trainers")["spec"]
    assert trainers["policyTypes"] == ["Ingress", "Egress"]
    egress = trainers["egress"]
    to_api, to_dns, to_gang, to_public = egress[0], egress[1], egress[2], egress[3]
    assert to_api["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "api"
    assert to_api["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert to_dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert {p["port"] for p in to_dns["ports"]} == {53}
    assert to_gang == {"to": [{"podSelector": {}}]}
    block = to_public["to"][0]["ipBlock"]
    assert block["cidr"] == "0.0.0.0/0" and {"169.254.0.0/16", "10.0.0.0/8", "100.64.0.0/10"} <= set(block["except"])
    assert to_public["ports"] == [{"port": 443, "protocol": "TCP"}]
    assert len(egress) == 4  # nothing else: no database, broker or metadata address


def test_notes_warn_when_the_database_is_missing():
    notes = render({})["tunefleet/templates/NOTES.txt"]
    assert "ACTION NEEDED: no database is configured" in notes
    notes = render(load_values("kueue"))["tunefleet/templates/NOTES.txt"]
    assert "ACTION NEEDED" not in notes and "gpu-jobs" in notes


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_container_command_exists(name):
    from tests.deploy.entrypoints import check_command

    for obj_name, spec in pod_specs(rendered_docs(name)):
        for container in spec["containers"]:
            assert check_command(container["command"]) == [], (obj_name, container["command"])


def test_base_models_configmap_is_accepted_by_the_service_parser():
    from control.models.base_models import BaseModelsFile

    docs = rendered_docs("two-pools-taints")
    config = one(docs, "ConfigMap", f"{FULL}-config")
    models = BaseModelsFile.model_validate(
        yaml.safe_load(config["data"]["base_models.yaml"])
    ).models
    assert [m.id for m in models] == [
        m["id"] for m in load_values("two-pools-taints")["baseModels"]
    ]
    assert models[0].inference_url == "http://vllm-llama-8b.inference.svc:8000"
    worker = one(docs, "Deployment", f"{FULL}-worker")["spec"]["template"]["spec"]["containers"][0]
    assert (
        env_of(worker)["TUNEFLEET_BASE_MODELS_FILE"]["value"] == "/etc/tunefleet/base_models.yaml"
    )
    # Without base models the service's built-in list applies and no file is named.
    default = one(rendered_docs("default"), "Deployment", f"{FULL}-worker")["spec"]["template"][
        "spec"
    ]
    assert "TUNEFLEET_BASE_MODELS_FILE" not in env_of(default["containers"][0])
    assert (
        "base_models.yaml"
        not in one(rendered_docs("default"), "ConfigMap", f"{FULL}-config")["data"]
    )


@pytest.mark.parametrize("component", ["api", "worker", "scheduler"])
def test_the_service_accepts_the_rendered_production_settings(component, monkeypatch):
    docs = rendered_docs("two-pools-taints")
    container = one(docs, "Deployment", f"{FULL}-{component}")["spec"]["template"]["spec"][
        "containers"
    ][0]
    settings = settings_from(resolved_env(docs, container), monkeypatch)
    assert settings.env == "production" and settings.executor == "kubernetes"
    assert settings.database_url.startswith("postgresql+psycopg://")
    assert settings.k8s_namespace == "tunefleet-training"


def test_an_http_public_url_starts_only_with_the_operators_opt_in(monkeypatch):
    base = {**load_values("two-pools-taints"), "publicUrl": "http://tunefleet.example.com"}

    def api_settings(values: dict) -> object:
        docs = tuple(d for path, text in sorted(render(values).items()) if path.endswith(".yaml")
                     for d in yaml.safe_load_all(text) if d)
        container = one(docs, "Deployment", f"{FULL}-api")["spec"]["template"]["spec"]["containers"][0]
        return settings_from(resolved_env(docs, container), monkeypatch)

    with pytest.raises(ValueError, match="TUNEFLEET_ALLOW_HTTP_PUBLIC_URL"):
        api_settings(base)
    assert api_settings({**base, "allowHttpPublicUrl": True}).allow_http_public_url is True
    # The chart's own in-cluster address (publicUrl empty) is http by construction.
    assert api_settings({**base, "publicUrl": ""}).public_url.startswith("http://")


def test_without_a_database_the_service_refuses_to_start_and_says_what_to_set(monkeypatch):
    docs = rendered_docs("default")
    container = one(docs, "Deployment", f"{FULL}-api")["spec"]["template"]["spec"]["containers"][0]
    with pytest.raises(ValueError, match="TUNEFLEET_DATABASE_URL"):
        settings_from(resolved_env(docs, container), monkeypatch)


def test_probe_paths_are_routes_of_the_api():
    import ast

    from tests.deploy.chart import REPO_ROOT

    routes = set()
    for path in (REPO_ROOT / "api").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                routes.add(node.args[0].value)
    api = one(rendered_docs("default"), "Deployment", f"{FULL}-api")["spec"]["template"]["spec"]
    probes = {
        api["containers"][0][probe]["httpGet"]["path"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert probes == {"/healthz", "/readyz"} and probes <= routes
