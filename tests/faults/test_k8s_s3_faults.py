"""The Kubernetes executor with an S3 artifact store, under faults.

The service (API, worker, scheduler with ``TUNEFLEET_EXECUTOR=kubernetes``) runs on the
fake Kubernetes API server (``tests/k8s/fake_apiserver.py``), whose kubelet runs each
trainer pod as a local process; the artifact bucket is a moto server behind
:class:`FlakyS3`, a small HTTP proxy the test can take down. Everything -- the API, the
worker and every trainer pod -- reaches S3 only through that proxy, so an outage is an
outage for all of them. Checkpoints, metrics logs and the adapter live in the bucket.

- a trainer pod killed mid-run: the job is requeued, its
  new pod (on an empty disk, as a new pod has) downloads the last checkpoint from S3 and
  trains on; every step's metrics arrive once and each loss is that of an uninterrupted
  run of the same spec;
- S3 unreachable while a checkpoint is uploaded: for a few requests (the S3 client's
  retries absorb it) and for longer than its retries last (the trainer fails with
  ``storage_unreachable``, the run is restarted from the last checkpoint that reached
  the bucket). Either way the job never succeeds with a checkpoint or the adapter
  missing from the bucket.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest

from tests.conftest import free_port
from tests.e2e.conftest import service, tiny_model_dir  # noqa: F401 (fixtures)
from tests.e2e.test_local_training import all_metrics, upload, wait_for
from tests.k8s.fake_apiserver import FakeApiServer
from tests.k8s.test_e2e_fake_cluster import (
    NS,
    _start_on_cluster,
    _start_uninterrupted_run,
    _wait_until_done,
)
from trainers.common.storage import DEFAULT_CACHE_DIR
from tunefleet.demo import demo_examples

BUCKET, PREFIX = "tunefleet-faults", "artifacts"
ACCESS_KEY, SECRET_KEY = "AKIAFAULTS0000000000", "faults/secret/key/00000000000000000000000"
TRAINER_SECRET = "trainer-s3"
JOB = {"model": "tunefleet-tiny-llama", "seed": 5, "max_seq_len": 48,
       "adapter": {"method": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"]}}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


class FlakyS3:
    """An HTTP proxy in front of an S3 server that goes dark on request.

    ``outage_on_checkpoint(step, requests=n)`` / ``(step, seconds=s)``: from the first PUT
    of an object under ``.../checkpoints/step-<step>/`` on, the next ``n`` requests (or
    every request for ``s`` seconds) get their connection closed without an answer, as a
    network partition or a crashed S3 gateway would do. ``dropped`` counts them.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.dropped = 0
        self.dropped_checkpoint_puts = 0
        self._lock = threading.Lock()
        self._armed: dict[str, float] | None = None  # step, requests, seconds
        self._left = 0
        self._until = 0.0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                body = self._read_body()
                if proxy._drop(self.command, self.path):
                    self.close_connection = True
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _read_body(self) -> bytes | None:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else None

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def outage_on_checkpoint(self, step: int, *, requests: int = 0, seconds: float = 0.0) -> None:
        with self._lock:
            self._armed = {"step": step, "requests": requests, "seconds": seconds}

    def _drop(self, method: str, path: str) -> bool:
        with self._lock:
            checkpoint_put = method == "PUT" and re.search(r"/checkpoints/step-\d+/", path) is not None
            if self._armed is not None and method == "PUT" and f"/checkpoints/step-{self._armed['step']}/" in path:
                self._left, self._until = int(self._armed["requests"]), time.monotonic() + self._armed["seconds"]
                self._armed = None
            if self._left > 0 or time.monotonic() < self._until:
                self._left = max(0, self._left - 1)
                self.dropped += 1
                self.dropped_checkpoint_puts += checkpoint_put
                return True
            return False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def flaky_s3():
    from moto.server import ThreadedMotoServer

    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    moto.start()
    proxy = FlakyS3(port)
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                 aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY).create_bucket(Bucket=BUCKET)
    yield proxy
    proxy.close()
    moto.stop()


def _bucket(proxy: FlakyS3):
    return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{proxy.upstream_port}", region_name="us-east-1",
                        aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)


def _keys(proxy: FlakyS3, prefix: str) -> set[str]:
    pages = _bucket(proxy).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def _start(service_factory, api: FakeApiServer, tmp_path: Path, proxy: FlakyS3, monkeypatch, **extra_env):
    """The service on the fake cluster, its artifacts in the bucket behind ``proxy``."""
    for name, value in {
        "TUNEFLEET_ARTIFACT_URL": f"s3://{BUCKET}/{PREFIX}", "TUNEFLEET_S3_ENDPOINT_URL": proxy.url,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
        "TUNEFLEET_K8S_TRAINER_SECRET": TRAINER_SECRET,
    }.items():
        monkeypatch.setenv(name, value)
    c, svc = _start_on_cluster(service_factory, api, tmp_path, **extra_env)
    c.create("secrets", NS, {"metadata": {"name": TRAINER_SECRET},
                             "stringData": {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}})
    return c, svc


def _staged_checkpoint_bytes(http, job_id: str) -> list[int]:
    events = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    return [int((e["data"] or {}).get("checkpoint_bytes", 0)) for e in reversed(events)
            if e["message"] == "s3:// inputs staged"]


def _assert_outputs_complete(proxy: FlakyS3, http, job: dict) -> None:
    """A succeeded job's adapter and metrics log (every step once) are whole in the bucket,
    and so is every checkpoint the API registered that keep_last has not pruned, the final
    one among them."""
    keys = _keys(proxy, f"{PREFIX}/{job['id']}/")
    for name in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json", "manifest.json"):
        assert f"{PREFIX}/{job['id']}/output/{name}" in keys, (name, sorted(keys))
    metrics = _bucket(proxy).get_object(Bucket=BUCKET, Key=f"{PREFIX}/{job['id']}/output/metrics.jsonl")
    logged = [json.loads(line)["step"] for line in metrics["Body"].read().decode().splitlines()]
    assert logged == list(range(1, job["total_steps"] + 1)), f"the output's metrics.jsonl has steps {logged}"
    steps = {ck["step_number"] for ck in http.get(f"/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]}
    assert job["total_steps"] in steps, steps
    for step in steps:
        folder = f"{PREFIX}/{job['id']}/checkpoints/step-{step}/"
        if step != job["total_steps"] and not any(k.startswith(folder) for k in keys):
            continue  # pruned (keep_last): gone as a whole
        for name in ("trainer_state.json", "adapter/adapter_model.safetensors"):
            assert f"{folder}{name}" in keys, (folder, name, sorted(keys))


def _stop_past_a_checkpoint(http, proxy: FlakyS3, job: dict, trainer) -> None:
    """Leave the (one-process) trainer SIGSTOPped two steps or more past a checkpoint the
    API lists, before its last step.

    The tiny job's steps take milliseconds: a test process waiting for a core while the
    trainer ran freely saw the first checkpoint listed only when the job was at its last
    one. So the trainer runs in 20 ms bursts and is read while stopped: its progress from
    the metrics.jsonl it writes at each step on the pod's disk, the checkpoint whole in
    the bucket (its trainer_state.json goes up last). The API hears of that checkpoint
    once the trainer's reporter has sent it, which on a loaded machine took longer than
    the job's remaining steps: from then on the trainer is given a second stopped, for the
    API to list it, between bursts."""
    metrics = Path(DEFAULT_CACHE_DIR) / "jobs" / job["id"] / "output" / "metrics.jsonl"
    checkpoints = f"{PREFIX}/{job['id']}/checkpoints/"

    def trained() -> int:
        try:
            return max((json.loads(line)["step"] for line in metrics.read_text().splitlines()), default=0)
        except (FileNotFoundError, ValueError):  # not there yet, or a line half written
            return 0

    def whole_in_bucket() -> list[int]:
        found = (re.fullmatch(r"step-(\d+)/trainer_state\.json", key[len(checkpoints):])
                 for key in _keys(proxy, checkpoints))
        return [int(m.group(1)) for m in found if m]

    def listed_by_api(step: int) -> bool:
        listed = [ck["step_number"] for ck in http.get(f"/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]]
        return bool(listed) and max(listed) + 2 <= step

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        trainer.send_signal(signal.SIGSTOP)
        assert trainer.poll() is None, "the trainer ended before it was stopped past a checkpoint"
        step = trained()
        assert step < job["total_steps"], (
            f"the trainer reached its last step ({step}) before the API listed a checkpoint")
        if step >= 3 and any(n + 2 <= step for n in whole_in_bucket()):
            for _ in range(10):  # a second stopped for the API; its report not sent yet: one more burst
                if listed_by_api(step):
                    return
                time.sleep(0.1)
        trainer.send_signal(signal.SIGCONT)
        time.sleep(0.02)
    raise AssertionError("timed out after 240s waiting for steps past a checkpoint")


@pytest.mark.slow
def test_a_killed_trainer_pod_resumes_from_its_checkpoint_in_s3_and_continues_the_same_curve(
        service, tmp_path, flaky_s3, monkeypatch):  # noqa: F811
    """A lost node takes the same path through the bucket (a requeue, a new pod on an empty
    disk); how its pod's loss is classified is tested on the fake cluster on its own
    (tests/k8s/test_reconcile_restart.py)."""
    reference = None
    with FakeApiServer(tmp_path / "k8s") as api:
        c, svc = _start(service, api, tmp_path, flaky_s3, monkeypatch)
        try:
            with svc.http() as http:
                file_id = upload(http, demo_examples(32, seed=8))
                job = http.post("/fine_tuning/jobs", json={
                    **JOB, "training_file": file_id, "hyperparameters": {"n_epochs": 4, "batch_size": 4}}).json()
                pod = wait_for(lambda: next((p for p in c.pods(job["id"]) if p["status"].get("phase") == "Running"
                                             and p["metadata"]["uid"] in c.procs), None), 240, "the trainer pod")
                trainer = c.procs[pod["metadata"]["uid"]]
                _stop_past_a_checkpoint(http, flaky_s3, job, trainer)
                reference = _start_uninterrupted_run(c, job["id"], tmp_path / "reference")
                trainer.send_signal(signal.SIGKILL)  # a stopped process dies of it too
                trainer.wait(timeout=30)
                # A new pod starts on an empty disk: what the lost one staged is gone with it.
                shutil.rmtree(Path(DEFAULT_CACHE_DIR) / "jobs" / job["id"], ignore_errors=True)
                done = _wait_until_done(http, c, svc, job["id"], timeout=400)
                assert done["status"] == "succeeded", done.get("error")
                assert done["restarts"] == 1 and done["resume_from"].startswith(f"s3://{BUCKET}/"), done
                staged = _staged_checkpoint_bytes(http, job["id"])
                assert len(staged) == 2 and staged[0] == 0 and staged[1] > 0, staged  # from the bucket
                rows = all_metrics(http, job["id"])
                _assert_outputs_complete(flaky_s3, http, done)
            assert reference.wait(timeout=300) == 0, (tmp_path / "reference" / "trainer.log").read_text()[-3000:]
        finally:
            if reference is not None and reference.poll() is None:
                reference.kill()
                reference.wait()
    assert [r["step"] for r in rows] == list(range(1, done["total_steps"] + 1))
    uninterrupted = [json.loads(line) for line in
                     (tmp_path / "reference" / "output" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in uninterrupted] == [r["step"] for r in rows]
    for row, ref in zip(rows, uninterrupted, strict=True):
        assert abs(row["train_loss"] - ref["train_loss"]) <= 1e-6, (row["step"], row["train_loss"], ref["train_loss"])


@pytest.mark.slow
# 12 steps, a checkpoint every 4: the outage starts with the upload of step-8, when step-4
# is whole in the bucket.
@pytest.mark.parametrize("outage", [
    {"requests": 2},  # the S3 client's retries ride it out: no restart
    # Longer than its retries: the run fails with storage_unreachable and is restarted from
    # step-4. The default restart backoff (10 s, then 20 s) outlasts the outage within
    # max_restarts=2; without it the restarts were used up in seconds and the job failed.
    {"seconds": 20.0},
])
def test_s3_unreachable_during_a_checkpoint_upload_never_ends_in_a_false_success(
        service, tmp_path, flaky_s3, monkeypatch, outage):  # noqa: F811
    with FakeApiServer(tmp_path / "k8s") as api:
        c, svc = _start(service, api, tmp_path, flaky_s3, monkeypatch, TUNEFLEET_RESTART_BACKOFF_S="10")
        with svc.http() as http:
            file_id = upload(http, demo_examples(16, seed=9))
            flaky_s3.outage_on_checkpoint(8, **outage)
            job = http.post("/fine_tuning/jobs", json={
                **JOB, "training_file": file_id, "hyperparameters": {"n_epochs": 3, "batch_size": 4}}).json()
            done = _wait_until_done(http, c, svc, job["id"], timeout=400)
            assert flaky_s3.dropped_checkpoint_puts >= 1, "the outage never hit a checkpoint upload"
            messages = [e["message"] for e in http.get(f"/fine_tuning/jobs/{job['id']}/events",
                                                      params={"limit": 100}).json()["data"]]
            if "requests" in outage:
                assert done["status"] == "succeeded" and done["restarts"] == 0, (done, messages)
            else:
                assert done["status"] == "succeeded" and done["restarts"] >= 1, (done, messages)
                assert done["resume_from"].endswith("/checkpoints/step-4"), done["resume_from"]
                assert any("backoff after a lost run" in m for m in messages), messages
            rows = all_metrics(http, job["id"])
            assert [r["step"] for r in rows] == list(range(1, done["total_steps"] + 1))
            _assert_outputs_complete(flaky_s3, http, done)


@pytest.mark.parametrize("remote_steps", [(4,), ()])
def test_a_newer_checkpoint_left_on_the_disk_by_a_failed_upload_is_not_resumed_from(
        flaky_s3, tmp_path, monkeypatch, remote_steps):
    """A pod's disk may outlive it (and the fake kubelet's does): resuming from the
    checkpoint whose upload failed would skip the steps the bucket's metrics log lacks."""
    from trainers.common.checkpointing import TrainerState, resolve_resume, save_checkpoint
    from trainers.common.data import DataCursor
    from trainers.common.storage import S3Staging
    from trainers.spec import TrainerSpec

    for name, value in {"TUNEFLEET_S3_ENDPOINT_URL": flaky_s3.url, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                        "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    job_id = f"ftjob-disk{len(remote_steps)}"  # moto's buckets outlive its server: one job per case
    base = f"s3://{BUCKET}/{PREFIX}/{job_id}"
    spec = TrainerSpec.model_validate({
        "job_id": job_id, "trainer": "fsdp_qlora", "model": {"path": str(tmp_path / "model")},
        "data": {"train_file": str(tmp_path / "train.jsonl"), "format": "chat"},
        "hyperparameters": {"n_epochs": 1, "batch_size": 4, "micro_batch_size": 4, "learning_rate": 1e-3},
        "output_dir": f"{base}/output", "checkpoint": {"dir": f"{base}/checkpoints", "resume_from": "latest"}})
    for step in remote_steps:  # complete in the bucket: trainer_state.json is there
        for name in ("adapter/adapter_model.safetensors", "trainer_state.json"):
            _bucket(flaky_s3).put_object(Bucket=BUCKET, Key=f"{PREFIX}/{job_id}/checkpoints/step-{step}/{name}",
                                         Body=b"{}")
    staging = S3Staging(spec, root=tmp_path / "cache")
    local = Path(staging.local_spec.checkpoint.dir)
    for step in (4, 8):  # this disk wrote both; the upload of step-8 failed
        save_checkpoint(local, TrainerState(step=step, epoch=0, cursor=DataCursor()),
                        lambda d: (d / "adapter_model.safetensors").write_bytes(b"w"), keep_last=3)

    staging.stage_inputs()

    resumed = resolve_resume(staging.local_spec.checkpoint)
    assert resumed == (local / "step-4" if remote_steps else None), resumed
    assert not (local / "step-8").exists()


def test_the_metrics_log_is_in_the_bucket_before_the_checkpoint_a_new_pod_may_resume_from(flaky_s3, tmp_path,
                                                                                         monkeypatch):
    """A pod killed right after a checkpoint became complete in the bucket (its
    trainer_state.json uploaded) must not leave the log there short of that step: the next
    pod resumes from the checkpoint and keeps only the log's rows up to it. The log used
    to go up after the checkpoint; a kill in between lost the steps since the one before."""
    from trainers.common.checkpointing import TrainerState, save_checkpoint
    from trainers.common.data import DataCursor
    from trainers.common.outputs import MetricsLog
    from trainers.common.storage import S3Staging, S3Storage
    from trainers.spec import TrainerSpec

    for name, value in {"TUNEFLEET_S3_ENDPOINT_URL": flaky_s3.url, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                        "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    base = f"s3://{BUCKET}/{PREFIX}/ftjob-order"
    spec = TrainerSpec.model_validate({
        "job_id": "ftjob-order", "trainer": "fsdp_qlora", "model": {"path": str(tmp_path / "model")},
        "data": {"train_file": str(tmp_path / "train.jsonl"), "format": "chat"},
        "hyperparameters": {"n_epochs": 1, "batch_size": 4, "micro_batch_size": 4, "learning_rate": 1e-3},
        "output_dir": f"{base}/output", "checkpoint": {"dir": f"{base}/checkpoints", "resume_from": "latest"}})
    uploaded: list[str] = []

    class KilledAfterTheCheckpoint(S3Storage):
        def upload(self, source, loc):
            super().upload(source, loc)
            uploaded.append(loc.key)
            if loc.key.endswith("/step-16/trainer_state.json"):
                raise SystemExit("the pod is killed here")

    staging = S3Staging(spec, root=tmp_path / "cache", storage=KilledAfterTheCheckpoint())
    log = MetricsLog(staging.output_dir)
    for step in range(1, 17):
        log.append({"step": step, "train_loss": 1.0 / step})
    path = save_checkpoint(Path(staging.local_spec.checkpoint.dir),
                           TrainerState(step=16, epoch=0, cursor=DataCursor()),
                           lambda d: (d / "adapter_model.safetensors").write_bytes(b"w"), keep_last=3)
    with pytest.raises(SystemExit):
        staging.publish_checkpoint(str(path))

    assert f"{PREFIX}/ftjob-order/checkpoints/step-16/trainer_state.json" in _keys(flaky_s3, f"{PREFIX}/ftjob-order/")
    body = _bucket(flaky_s3).get_object(Bucket=BUCKET, Key=f"{PREFIX}/ftjob-order/output/metrics.jsonl")["Body"]
    assert [json.loads(line)["step"] for line in body.read().decode().splitlines()] == list(range(1, 17)), uploaded
