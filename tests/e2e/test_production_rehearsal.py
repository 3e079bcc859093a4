"""The production path rehearsed from the Helm chart, as an operator deploys it.

The chart is rendered with production values (``environment: production``, external
PostgreSQL and Redis, an S3 artifact store -- a moto server -- with static keys by value,
a trainer ServiceAccount (IRSA), the Kubernetes executor on two node pools, a metrics
token, a trainer PriorityClass and runtime limit, Kueue with WorkloadPriorityClasses).
The migration Job's container, then the API's (each of its replicas), worker's and
scheduler's, run as local processes exactly as rendered (``tests/e2e/rehearsal.py`` lists
what a process gets that a pod would not). The rendered
objects of the training namespace (its Namespace, the trainer credentials Secret) are
created in the fake Kubernetes API server, whose kubelet runs each trainer pod with the
env, envFrom, mounts and command the executor gave it, and with what the trainer image
sets (its HOME) on a read-only root filesystem: it writes to its volumes only. Its
scheduler fits the trainer's CPU and memory requests on the pool's nodes. A credential,
setting or writable volume the chart or the executor forgets fails the job here as it
would on a cluster.

Through the official ``openai`` SDK a file is uploaded and a job created on a base model
that lives in the bucket (``s3://``); the test plays Kueue (the Job is created suspended
and admitted after a delay); the job trains on the pool that holds it, its adapter is
written to the bucket and downloads through the API; the API's, worker's and scheduler's
``/metrics`` answer the metrics token only, and their database gauges, summed over every
replica, count the job once.
Then two more jobs: one whose trainer pod is OOMKilled (failed, out_of_memory, not
retried), one cancelled while it trains.

Production refuses webhook targets on private addresses, which is all this machine has:
the test checks that refusal, then registers a receiver the operator allowed by its
``host:port`` (``webhooks.allowedHosts``, as for an in-cluster receiver), which the worker
delivers the job's ``succeeded`` event to, signed (checked with ``standardwebhooks``). Not rehearsed
here: a preemption (by a higher-priority job or by Kueue re-suspending the Job), so
neither is the Job's podFailurePolicy for it.
"""

from __future__ import annotations

import io
import json
import secrets
import socket
import time
from pathlib import Path

import boto3
import httpx
import pytest
import yaml
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from standardwebhooks import Webhook

from tests.conftest import IN_CI, PG_ADMIN_DSN, free_port
from tests.deploy.chart import find
from tests.e2e.conftest import tiny_model_dir  # noqa: F401 (fixture)
from tests.e2e.rehearsal import (
    Container,
    apply_to_fake_cluster,
    process_env,
    rendered,
    trainer_image_env,
)
from tests.e2e.test_local_training import wait_for
from tests.integrations.webhook_receiver import Receiver
from tests.k8s.fake_apiserver import FakeApiServer
from tests.k8s.test_e2e_fake_cluster import RTX_POOL, SMALL_POOL
from tunefleet.demo import demo_examples

pytestmark = pytest.mark.slow

FULL = "tf-tunefleet"
TRAINING_NS = "tunefleet-training"
BUCKET = "tunefleet-artifacts"
MODEL_ID = "tiny-llama-s3"
ROLE_ARN = "arn:aws:iam::123456789012:role/tunefleet-trainer"
ACCESS_KEY, SECRET_KEY = "AKIAREHEARSAL0000000", "rehearsal/secret/key/0000000000000000000"
TRAINER_IMAGE = "ghcr.io/tunefleet/trainer-torch-cuda:rehearsal"
# The rtx4090 pool's CPU and memory per trainer GPU, and its nodes' allocatable: two 1-GPU
# trainers fit a node at these requests, not at the pools file's defaults (4 CPU, 16 GiB).
RTX_TRAINER_RESOURCES = {"cpu_per_gpu": 1.5, "memory_gib_per_gpu": 6, "memory_limit_gib_per_gpu": 8}
RTX_NODE = {"cpu": "4", "memory": "16Gi"}


def _host_address() -> str:
    """An address of this machine that is not loopback (production refuses a loopback
    public URL: trainer pods could not reach it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("198.51.100.1", 9))  # no packet is sent: this only picks the route
            address = sock.getsockname()[0]
    except OSError:  # no route out: an address the host name resolves to
        address = socket.gethostbyname(socket.gethostname())
    if address.startswith("127."):
        # Nothing the service can change: production refuses a loopback public URL. Skipped
        # on such a laptop, a failure in CI, which must rehearse the production path.
        message = "this machine has no address but loopback to serve the API on"
        if IN_CI:
            pytest.fail(f"{message} (CI=true: the rehearsal is required)", pytrace=False)
        pytest.skip(message)
    return address


@pytest.fixture
def database():
    """A new, empty PostgreSQL database: the migration Job creates its schema."""
    import psycopg  # the service's PostgreSQL driver: always installed
    name = f"tunefleet_rehearsal_{secrets.token_hex(4)}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _values(*, database: str, broker: str, s3: str, public_url: str, port: int, admin_key: str,
            metrics_token: str, webhook_receiver: str) -> dict:
    pools = [{**SMALL_POOL, "trainer_image": TRAINER_IMAGE},
             {**RTX_POOL, "trainer_image": TRAINER_IMAGE, "trainer_resources": RTX_TRAINER_RESOURCES}]
    return {
        "environment": "production",
        "publicUrl": public_url,
        "allowHttpPublicUrl": True,  # TLS is not part of this rehearsal
        "database": {"url": database},
        "broker": {"url": broker},
        "artifacts": {"url": f"s3://{BUCKET}/tunefleet",
                      "s3": {"endpointUrl": s3, "region": "us-east-1", "accessKeyId": ACCESS_KEY,
                             "secretAccessKey": SECRET_KEY}},
        "auth": {"adminApiKey": admin_key, "metricsToken": metrics_token},
        "webhooks": {"allowedHosts": [webhook_receiver]},
        "training": {"namespace": TRAINING_NS, "createNamespace": True, "priorityClassName": "training-batch",
                     "maxRuntimeSeconds": 3600,
                     "serviceAccount": {"create": True, "annotations": {"eks.amazonaws.com/role-arn": ROLE_ARN}}},
        "kueue": {"enabled": True, "localQueue": "gpu-jobs", "createLocalQueue": True, "clusterQueue": "team-a",
                  "priorityClasses": {"low": "batch-low", "normal": "batch", "high": "batch-high"}},
        "pools": pools,
        "baseModels": [{"id": MODEL_ID, "path": f"s3://{BUCKET}/models/tiny-llama", "params_b": 0.0001,
                        "max_seq_len": 512}],
        # one uvicorn process and two Celery threads: the machine running this is small
        "api": {"port": port, "workers": 1},
        "worker": {"concurrency": 2},
        "scheduler": {"intervalSeconds": 1},
    }


def _upload_model(s3: str, model_dir: Path) -> None:
    bucket = boto3.client("s3", endpoint_url=s3, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY)
    bucket.create_bucket(Bucket=BUCKET)
    for path in sorted(model_dir.rglob("*")):
        if path.is_file():
            bucket.upload_file(str(path), BUCKET, f"models/tiny-llama/{path.relative_to(model_dir)}")


def _kubeconfig(path: Path, url: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "control-plane", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "control-plane"}}]}))
    return path


def test_a_job_on_an_s3_model_trains_on_the_control_plane_the_chart_deploys(
    tmp_path, tiny_model_dir, redis_url, database, s3_endpoint  # noqa: F811
):
    port = free_port()
    public_url = f"http://{_host_address()}:{port}"
    admin_key = f"tf_{secrets.token_hex(4)}_{secrets.token_hex(16)}"
    metrics_token = secrets.token_urlsafe(24)
    receiver = Receiver().start()
    docs = rendered(_values(database=database, broker=redis_url, s3=s3_endpoint, public_url=public_url, port=port,
                            admin_key=admin_key, metrics_token=metrics_token,
                            webhook_receiver=receiver.url.split("/")[2]))
    _upload_model(s3_endpoint, tiny_model_dir)

    with FakeApiServer(tmp_path / "k8s") as api:
        c = api.cluster
        created = apply_to_fake_cluster(c, docs, TRAINING_NS)
        assert f"Secret/{FULL}-trainer-s3" in created, created  # the static keys, where trainer pods read them
        for pool, size in ((SMALL_POOL, {}), (RTX_POOL, RTX_NODE)):
            c.add_node(f"{pool['name']}-0", labels=pool["node_selector"], gpus=pool["gpus_per_node"],
                       resource_name=pool["resource_name"],
                       taints=[{"key": t["key"], "effect": t["effect"],
                                **({"value": t["value"]} if "value" in t else {})}
                               for t in pool["tolerations"]], **size)
        # the trainer image's HOME and HF_HOME, and its read-only root filesystem
        c.images[TRAINER_IMAGE] = trainer_image_env()
        c.read_only_root = True
        kubeconfig = _kubeconfig(tmp_path / "kubeconfig", api.url)

        def container(kind: str, component: str, *, cluster_access: bool = True, replica: int = 0) -> Container:
            # a second replica of a Deployment is one more pod: its ports are its own
            return Container.from_chart(docs, kind, f"{FULL}-{component}", tmp_path / f"{component}-{replica}",
                                        process_env(kubeconfig if cluster_access else None, tmp_path / "home"),
                                        shared_ports=("metrics", "http") if replica else ("metrics",))

        (tmp_path / "home").mkdir()
        # Helm runs the migration Job before it creates the Deployments because it is a hook
        (hook,) = find(docs, "Job", f"{FULL}-migrations")
        assert {"pre-install", "pre-upgrade"} <= set(hook["metadata"]["annotations"]["helm.sh/hook"].split(","))
        migrations = container("Job", "migrations", cluster_access=False)
        assert migrations.run(timeout=180) == 0, migrations.tail()
        # every replica of the API -- the chart's default of two, so that database gauges every
        # replica exported would count twice -- one worker and the scheduler
        (api_deployment,) = find(docs, "Deployment", f"{FULL}-api")
        assert api_deployment["spec"]["replicas"] == 2
        roles = [container("Deployment", "api", replica=i) for i in range(api_deployment["spec"]["replicas"])]
        roles += [container("Deployment", name) for name in ("worker", "scheduler")]
        for role in roles:
            role.start()
        try:
            _rehearse(c, roles, public_url, admin_key, metrics_token, s3_endpoint, receiver)
        except BaseException:
            print(*(r.tail() for r in [migrations, *roles]),
                  # every trainer pod that started, deleted ones too (a relaunch deletes them)
                  *(f"----- pod {uid} -----\n{c.read_log(uid)[-3000:]}" for uid in c.pod_dirs), sep="\n")
            raise
        finally:
            for role in roles:
                role.stop()
            receiver.stop()


def _rehearse(c, roles, public_url, admin_key, metrics_token, s3_endpoint, receiver) -> None:
    *api_replicas, worker, scheduler = roles
    # the first replica behind the public URL (the Service), the others on their own ports
    apis = {public_url: api_replicas[0], **{f"http://127.0.0.1:{r.ports['http']}": r for r in api_replicas[1:]}}
    for url, api_role in apis.items():
        wait_for(lambda u=url, r=api_role: _ready(u) or not r.alive(), 90, f"the API replica at {url} to be ready")
        assert api_role.alive(), f"the API replica at {url} exited"
    oai = OpenAI(api_key=admin_key, base_url=f"{public_url}/v1", max_retries=0, timeout=30.0)
    http = httpx.Client(base_url=f"{public_url}/v1", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30)

    # production refuses a webhook on a private address (all this machine has)
    refused = http.post("/webhooks", json={"url": f"{public_url}/hooks"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "webhook_url_not_public", refused.text
    # ... but takes the receiver the operator allowed
    endpoint = http.post("/webhooks", json={"url": receiver.url, "events": ["fine_tuning.job.succeeded"]})
    assert endpoint.status_code == 200, endpoint.text

    body = "".join(json.dumps(e) + "\n" for e in demo_examples()[:16]).encode()
    uploaded = oai.files.create(file=("train.jsonl", io.BytesIO(body)), purpose="fine-tune")
    wait_for(lambda: oai.files.retrieve(uploaded.id).status != "uploaded", 90, "file validation")
    assert oai.files.retrieve(uploaded.id).status == "processed"
    job = oai.fine_tuning.jobs.create(
        model=MODEL_ID, training_file=uploaded.id, seed=3, hyperparameters={"n_epochs": 1, "batch_size": 8},
        extra_body={"max_seq_len": 48, "adapter": {"method": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"]}})

    # Kueue: the Job is created suspended in the LocalQueue; the test admits it a little later
    def suspended_job():
        return next((j for j in c.list("jobs", TRAINING_NS) if j["metadata"]["labels"].get("tunefleet.io/job-id")
                     == job.id), None)

    k8s_job = wait_for(suspended_job, 120, "the training Job")
    labels = k8s_job["metadata"]["labels"]
    assert k8s_job["spec"]["suspend"] is True
    assert labels["kueue.x-k8s.io/queue-name"] == "gpu-jobs" and labels["kueue.x-k8s.io/priority-class"] == "batch"
    pod = k8s_job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == RTX_POOL["node_selector"]  # the small pool cannot hold it
    assert pod["priorityClassName"] == "training-batch" and k8s_job["spec"]["activeDeadlineSeconds"] == 3600
    assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": f"{FULL}-trainer-s3"}}]
    # the identity for IRSA / workload identity, with no Kubernetes API token
    assert pod["serviceAccountName"] == f"{FULL}-trainer" and pod["automountServiceAccountToken"] is False
    # the pool's CPU and memory for one GPU (what the scheduler fits on its nodes), the memory
    # limit that gets an out-of-memory trainer OOMKilled alone
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "1500m", "memory": "6Gi", "nvidia.com/gpu": "1"},
                                                 "limits": {"memory": "8Gi", "nvidia.com/gpu": "1"}}
    # what the fake kubelet enforces: the trainer writes to its volumes only
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    time.sleep(2)
    assert not c.pods(job.id), "pods of a Job Kueue has not admitted"
    wait_for(lambda: any("waiting for Kueue" in e.message for e in oai.fine_tuning.jobs.list_events(job.id).data),
               30, "the 'waiting for Kueue' event")
    held = oai.fine_tuning.jobs.retrieve(job.id)  # admitted by tunefleet, not started by Kueue: still queued
    assert held.status == "queued" and held.model_extra["queue_reason"].startswith("admitted, waiting for Kueue"), held
    code, _ = c.patch("jobs", TRAINING_NS, k8s_job["metadata"]["name"], {"spec": {"suspend": False}})
    assert code == 200

    done = wait_for(lambda: (j := oai.fine_tuning.jobs.retrieve(job.id)).status in ("succeeded", "failed", "cancelled")
                      and j, 300, "the job to finish")
    assert done.status == "succeeded", done.error
    assert done.model_extra["pool"] == RTX_POOL["name"] and done.trained_tokens
    assert done.fine_tuned_model

    # the worker delivered the succeeded event, signed with the endpoint's secret
    (delivered,) = receiver.wait_for(lambda received: bool(received), 90)
    event = Webhook(endpoint.json()["secret"]).verify(delivered.body, delivered.headers)
    assert event["type"] == "fine_tuning.job.succeeded" and event["data"]["id"] == job.id, event

    # the adapter is in the bucket, and downloads through the API
    bucket = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY)
    keys = [o["Key"] for o in bucket.list_objects_v2(Bucket=BUCKET, Prefix="tunefleet/").get("Contents", [])]
    assert any(k.endswith("adapter/adapter_model.safetensors") for k in keys), keys
    listing = {a["name"]: a for a in http.get(f"/fine_tuning/jobs/{job.id}/artifacts").json()["data"]}
    artifact = listing["adapter/adapter_model.safetensors"]
    got = http.get(f"/fine_tuning/jobs/{job.id}/artifacts/adapter/adapter_model.safetensors", follow_redirects=True)
    assert got.status_code == 200 and len(got.content) == artifact["bytes"]

    # /metrics of every component: the metrics token and nothing else; the database gauges
    # summed over all of them count the job once
    endpoints = [f"{url}/metrics" for url in apis] + [
        f"http://127.0.0.1:{r.ports['metrics']}/metrics" for r in (worker, scheduler)]
    succeeded = 0.0
    for url in endpoints:
        assert httpx.get(url, timeout=10).status_code == 401, url
        scraped = httpx.get(url, headers={"Authorization": f"Bearer {metrics_token}"}, timeout=10)
        assert scraped.status_code == 200, (url, scraped.text[:500])
        succeeded += sum(s.value for f in text_string_to_metric_families(scraped.text) if f.name == "tunefleet_jobs"
                         for s in f.samples if s.labels.get("status") == "succeeded")
    assert succeeded == 1, succeeded
    long_body = "".join(json.dumps(e) + "\n" for e in demo_examples()[:16] * 8).encode()
    long_file = oai.files.create(file=("long.jsonl", io.BytesIO(long_body)), purpose="fine-tune")
    wait_for(lambda: oai.files.retrieve(long_file.id).status == "processed", 90, "the long file's validation")
    _oom_killed_and_cancelled(c, oai, long_file.id)
    for role in roles:
        assert role.alive(), role.tail()


def _admit(c, oai, job_id: str) -> dict:
    """Play Kueue for ``job_id``: its Job, once created suspended, is let run; the Job."""
    k8s_job = wait_for(lambda: next((j for j in c.list("jobs", TRAINING_NS) if j["metadata"]["labels"].get(
        "tunefleet.io/job-id") == job_id), None), 120, f"the training Job of {job_id}")
    assert k8s_job["spec"]["suspend"] is True
    code, _ = c.patch("jobs", TRAINING_NS, k8s_job["metadata"]["name"], {"spec": {"suspend": False}})
    assert code == 200
    return k8s_job


def _oom_killed_and_cancelled(c, oai, file_id: str) -> None:
    """Two long jobs at once on the 2-GPU pool: one trainer pod is OOMKilled (the job fails
    with out_of_memory, not retried), the other job is cancelled while it trains (its pod
    is stopped and its Job deleted)."""
    long = {"model": MODEL_ID, "training_file": file_id, "seed": 3,
            # 6400 steps (128 lines x 50 epochs): minutes even on a quiet machine (800 steps
            # took 25 s), so both are stopped while they train
            "hyperparameters": {"n_epochs": 50, "batch_size": 1},
            "extra_body": {"max_seq_len": 48, "adapter": {"method": "lora", "r": 4, "target_modules": ["q_proj"]}}}
    oom, cancelled = oai.fine_tuning.jobs.create(**long), oai.fine_tuning.jobs.create(**long)
    for job in (oom, cancelled):
        _admit(c, oai, job.id)
    for job in (oom, cancelled):
        wait_for(lambda j=job: (oai.fine_tuning.jobs.retrieve(j.id).model_extra.get("current_step") or 0) >= 1, 180,
                   f"{job.id} to train")
    (pod,) = [p for p in c.pods(oom.id) if p["status"].get("phase") == "Running"]
    c.oom_kill(pod["metadata"]["name"])
    oai.fine_tuning.jobs.cancel(cancelled.id)

    failed = wait_for(lambda: (j := oai.fine_tuning.jobs.retrieve(oom.id)).status in ("failed", "succeeded") and j,
                        60, "the OOM-killed job to fail")
    assert failed.status == "failed" and failed.error.code == "out_of_memory", failed.error
    assert wait_for(lambda: oai.fine_tuning.jobs.retrieve(cancelled.id).status == "cancelled", 60, "the cancel")
    wait_for(lambda: not c.list("jobs", TRAINING_NS, f"tunefleet.io/job-id={cancelled.id}"), 60,
             "the cancelled job's Kubernetes Job to be deleted")
    launched = [o for _, r, _, t, o in c.history if r == "jobs" and t == "ADDED"
                and o["metadata"]["labels"].get("tunefleet.io/job-id") == oom.id]
    assert len(launched) == 1  # out of memory is not retried
    assert not any(p.poll() is None for p in c.procs.values()), "a trainer process outlived its job"


def _ready(public_url: str) -> bool:
    try:
        return httpx.get(f"{public_url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
