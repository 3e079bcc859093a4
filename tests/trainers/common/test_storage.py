"""s3:// locations (trainers.common.storage) against a real S3 protocol server (moto_server).

Staging a sharded model + data into the ETag-keyed cache, a full ``python -m trainers``
run whose model, data, output and checkpoint locations are all s3://, a SIGTERM + resume
from the bucket on a fresh cache (a new pod) that continues the same losses, and the
error codes for missing objects, refused credentials and an unreachable endpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainers.common.storage import (
    S3Location,
    S3Staging,
    S3Storage,
    StorageAccessDenied,
    StorageUnreachable,
)
from trainers.errors import UserError
from trainers.exit_codes import ExitCode

REPO = Path(__file__).resolve().parents[3]
MOTO = Path(sys.executable).with_name("moto_server")
BUCKET = "tunefleet"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto(extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([str(MOTO), "-H", "127.0.0.1", "-p", str(port)], env={**os.environ, **(extra_env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def s3_endpoint():
    proc, url = _start_moto()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch, tmp_path):
    """This process talks to the moto server; the cache dir is per test."""
    for k, v in {**CREDS, "TUNEFLEET_S3_ENDPOINT_URL": s3_endpoint, "AWS_MAX_ATTEMPTS": "2",
                 "TUNEFLEET_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    return s3_endpoint


def _client(endpoint: str, **creds):
    import boto3
    from botocore.config import Config

    kw = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", **creds}
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}), **kw)


def _upload_dir(client, src: Path, prefix: str) -> None:
    for p in sorted(src.rglob("*")):
        if p.is_file():
            client.upload_file(str(p), BUCKET, f"{prefix}/{p.relative_to(src).as_posix()}")


def _keys(client, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def bucket(s3_endpoint, tmp_path_factory, tiny_datasets):
    """A bucket holding a sharded tiny Llama (plus a .pth the stager must skip) and the data."""
    from trainers.common.tiny_model import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("sharded-llama"), seed=0, max_shard_size="40KB")
    assert len(list(model_dir.glob("model-*.safetensors"))) > 1  # really sharded
    client = _client(s3_endpoint)
    client.create_bucket(Bucket=BUCKET)
    _upload_dir(client, model_dir, "models/tiny")
    client.put_object(Bucket=BUCKET, Key="models/tiny/original/consolidated.00.pth", Body=b"x" * 1000)
    client.upload_file(str(tiny_datasets["chat_train"]), BUCKET, "files/file-train.jsonl")
    client.upload_file(str(tiny_datasets["chat_valid"]), BUCKET, "files/file-valid.jsonl")
    return {"client": client, "model_dir": model_dir}


def _s3_spec(make_spec, job: str, **changes):
    """make_spec with every location on S3; ``changes`` are merged into that."""
    base = f"s3://{BUCKET}/jobs/{job}"
    locations = {
        "job_id": job,
        "model": {"path": f"s3://{BUCKET}/models/tiny"},
        "data": {"train_file": f"s3://{BUCKET}/files/file-train.jsonl",
                 "validation_file": f"s3://{BUCKET}/files/file-valid.jsonl"},
        "output_dir": f"{base}/output",
        "checkpoint": {"dir": f"{base}/checkpoints", "every_n_steps": 2, "keep_last": 2},
    }
    for key, value in changes.items():
        locations[key] = {**locations[key], **value} if isinstance(value, dict) else value
    return make_spec(run=job, **locations)


# ---- staging (in process) ------------------------------------------------------------------


def test_stages_a_sharded_model_and_data_and_downloads_only_changed_objects(s3_env, bucket, make_spec, tmp_path):
    spec = _s3_spec(make_spec, "ftjob-stage")
    staging = S3Staging(spec)
    local = staging.local_spec
    # The recipe sees local paths only; the job's own spec is untouched.
    for value in (local.model.path, local.data.train_file, local.data.validation_file, local.output_dir,
                  local.checkpoint.dir):
        assert not value.startswith("s3://") and value.startswith(str(tmp_path / "cache"))
    assert spec.model.path == f"s3://{BUCKET}/models/tiny"

    stats = staging.stage_inputs()
    src, dst = bucket["model_dir"], Path(local.model.path)
    expected = sorted(p.name for p in src.iterdir() if p.is_file())
    assert sorted(p.name for p in dst.iterdir() if not p.name.startswith(".")) == expected
    for name in expected:
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert not (dst / "original").exists()  # the .pth is never downloaded
    assert stats["model_bytes"] == sum((src / n).stat().st_size for n in expected)
    assert Path(local.data.train_file).read_bytes() == bucket["client"].get_object(
        Bucket=BUCKET, Key="files/file-train.jsonl")["Body"].read()

    # A restarted pod with the same cache downloads nothing ...
    assert S3Staging(spec).stage_inputs() == {"model_bytes": 0, "data_bytes": 0, "checkpoint_bytes": 0}
    # ... and after one shard changed upstream (new ETag), only that shard.
    shard = min(src.glob("model-*.safetensors"))
    changed = shard.read_bytes()[:-4] + b"\0\0\0\0"
    bucket["client"].put_object(Bucket=BUCKET, Key=f"models/tiny/{shard.name}", Body=changed)
    try:
        again = S3Staging(spec).stage_inputs()
        assert again["model_bytes"] == len(changed) and again["data_bytes"] == 0
        assert (dst / shard.name).read_bytes() == changed
    finally:
        bucket["client"].upload_file(str(shard), BUCKET, f"models/tiny/{shard.name}")


def test_stages_the_adapter_of_the_fine_tuned_model_a_job_continues(s3_env, bucket, make_spec, tmp_path):
    from tests.trainers.lineage import random_peft_adapter

    adapter = random_peft_adapter(bucket["model_dir"], tmp_path / "parent")
    _upload_dir(bucket["client"], adapter, "jobs/ftjob-parent/output/adapter")
    uri = f"s3://{BUCKET}/jobs/ftjob-parent/output/adapter"
    spec = _s3_spec(make_spec, "ftjob-child", model={"parent_adapters": [{"path": uri, "name": "ft:p"}]})
    staging = S3Staging(spec)
    (local,) = staging.local_spec.model.parent_adapters
    assert local.name == "ft:p" and local.path.startswith(str(tmp_path / "cache"))
    staging.stage_inputs()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (Path(local.path) / name).read_bytes() == (adapter / name).read_bytes()


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"model": {"path": f"s3://{BUCKET}/models/nope"}}, "model_not_found"),
        ({"model": {"parent_adapters": [{"path": f"s3://{BUCKET}/jobs/gone/output/adapter"}]}},
         "parent_adapter_not_found"),
        ({"model": {"path": "s3://no-such-bucket/models/tiny"}}, "model_not_found"),
        ({"data": {"train_file": f"s3://{BUCKET}/files/missing.jsonl"}}, "dataset_not_found"),
        ({"data": {"validation_file": "s3://no-such-bucket/v.jsonl"}}, "dataset_not_found"),
        ({"checkpoint": {"resume_from": f"s3://{BUCKET}/jobs/x/checkpoints/step-9"}}, "checkpoint_not_found"),
    ],
)
def test_missing_objects_are_user_errors_with_stable_codes(s3_env, bucket, make_spec, changes, code):
    spec = _s3_spec(make_spec, "ftjob-missing", **changes)
    with pytest.raises(UserError) as err:
        S3Staging(spec).stage_inputs()
    assert err.value.code == code and "s3://" in err.value.message


@pytest.mark.parametrize(
    "changes",
    [
        {"model": {"path": "s3:///no-bucket"}},
        {"data": {"train_file": "s3://b/../etc/passwd"}},
        {"output_dir": "s3://b/job", "checkpoint": {"dir": "s3://b/job/checkpoints"}},  # nested: syncs collide
    ],
)
def test_malformed_or_colliding_locations_are_invalid_spec(make_spec, changes):
    with pytest.raises(UserError) as err:
        S3Staging(make_spec(**changes))
    assert err.value.code == "invalid_spec"


def test_unreachable_endpoint_and_missing_credentials(monkeypatch, tmp_path):
    loc = S3Location.parse(f"s3://{BUCKET}/models/tiny")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TUNEFLEET_S3_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens
    with pytest.raises(StorageUnreachable) as err:
        S3Storage().list(loc, what="model", missing_code="model_not_found")
    assert err.value.code == "storage_unreachable" and "127.0.0.1" in err.value.message

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StorageAccessDenied) as err:
        S3Storage().list(loc, what="model", missing_code="model_not_found")
    assert err.value.code == "storage_access_denied" and err.value.exit_code == ExitCode.USER_ERROR


def test_refused_credentials_are_storage_access_denied(monkeypatch):
    # A second server that checks access keys (moto's IAM auth from the first request on).
    proc, url = _start_moto({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        storage = S3Storage(_client(url, aws_access_key_id="AKIAWRONG", aws_secret_access_key="wrong"))
        with pytest.raises(StorageAccessDenied) as err:
            storage.list(S3Location.parse(f"s3://{BUCKET}/models/tiny"), what="model", missing_code="model_not_found")
        assert "InvalidAccessKeyId" in err.value.message
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_entry_point_reports_a_missing_model_with_its_code(s3_env, bucket, make_spec, tmp_path):
    from trainers.__main__ import main

    spec = _s3_spec(make_spec, "ftjob-nomodel", model={"path": f"s3://{BUCKET}/models/absent"},
                    termination_log=str(tmp_path / "termination-log"))
    spec.dump(tmp_path / "spec.json")
    assert main(["--spec", str(tmp_path / "spec.json")]) == ExitCode.USER_ERROR
    assert json.loads(Path(spec.termination_log).read_text())["code"] == "model_not_found"


# ---- the real entry point, everything on S3 (subprocesses) ---------------------------------


def _env(endpoint: str, cache: Path) -> dict[str, str]:
    return {**os.environ, **CREDS, "TUNEFLEET_S3_ENDPOINT_URL": endpoint, "TUNEFLEET_CACHE_DIR": str(cache),
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}


def _start(spec, path: Path, endpoint: str, cache: Path) -> subprocess.Popen:
    spec.dump(path)
    return subprocess.Popen([sys.executable, "-m", "trainers", "--spec", str(path)], cwd=REPO,
                            env=_env(endpoint, cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _reports(cache: Path, job: str) -> list[dict]:
    path = cache / "jobs" / job / "checkpoints" / "reports.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _remote_json(client, key: str):
    return json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())


def _remote_losses(client, job: str) -> dict[int, float]:
    body = client.get_object(Bucket=BUCKET, Key=f"jobs/{job}/output/metrics.jsonl")["Body"].read().decode()
    return {row["step"]: row["train_loss"] for row in map(json.loads, body.splitlines())}


STEPS = {"max_steps": 10, "learning_rate": 1e-2}


@pytest.fixture(scope="module")
def uninterrupted(s3_endpoint, bucket, tmp_path_factory, tiny_model_dir, tiny_datasets):
    """One all-s3 run of 10 steps, never interrupted (the reference for the resume test)."""
    from trainers.spec import TrainerSpec

    tmp = tmp_path_factory.mktemp("s3run")
    spec = TrainerSpec.model_validate(_spec_dict("ftjob-s3full", tmp))
    proc = _start(spec, tmp / "spec.json", s3_endpoint, tmp / "cache")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == ExitCode.SUCCESS, out
    return {"spec": spec, "cache": tmp / "cache", "job": "ftjob-s3full"}


def _spec_dict(job: str, tmp: Path) -> dict:
    base = f"s3://{BUCKET}/jobs/{job}"
    return {
        "job_id": job, "trainer": "fsdp_qlora", "model": {"path": f"s3://{BUCKET}/models/tiny"},
        "data": {"train_file": f"s3://{BUCKET}/files/file-train.jsonl",
                 "validation_file": f"s3://{BUCKET}/files/file-valid.jsonl", "format": "chat", "max_seq_len": 64},
        "hyperparameters": {"n_epochs": 1, "batch_size": 4, "micro_batch_size": 2, "warmup_steps": 0, **STEPS},
        "adapter": {"r": 4, "alpha": 8.0, "dropout": 0.0},
        "eval": {"every_n_steps": 5, "max_batches": 1},
        "output_dir": f"{base}/output",
        "checkpoint": {"dir": f"{base}/checkpoints", "every_n_steps": 2, "keep_last": 2, "resume_from": "latest"},
        "termination_log": str(tmp / "termination-log"),
        "seed": 0,
    }


def test_all_s3_run_uploads_adapter_with_manifest_checksums_and_checkpoints(uninterrupted, bucket):
    client, job = bucket["client"], uninterrupted["job"]
    reports = _reports(uninterrupted["cache"], job)
    assert "error" not in [r["type"] for r in reports]
    ckpts = [r for r in reports if r["type"] == "checkpoint"]
    assert [c["step"] for c in ckpts] == [2, 4, 6, 8, 10]
    assert [c["location"] for c in ckpts] == [
        f"s3://{BUCKET}/jobs/{job}/checkpoints/step-{s}" for s in (2, 4, 6, 8, 10)]
    # keep_last=2 is applied in the bucket too; each kept checkpoint is complete.
    remote = _keys(client, f"jobs/{job}/checkpoints/")
    assert {k.split("/")[3] for k in remote} == {"step-8", "step-10"}
    for step in (8, 10):
        prefix = f"jobs/{job}/checkpoints/step-{step}/"
        assert {prefix + "trainer_state.json", prefix + "dcp/.metadata",
                prefix + "adapter/adapter_model.safetensors"} <= set(remote)
        assert _remote_json(client, prefix + "trainer_state.json")["step"] == step

    (artifacts,) = [r for r in reports if r["type"] == "artifacts"]
    assert artifacts["location"] == f"s3://{BUCKET}/jobs/{job}/output"
    names = {f["name"] for f in artifacts["files"]}
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json", "training_config.json",
            "metrics.jsonl"} <= names
    manifest = _remote_json(client, f"jobs/{job}/output/manifest.json")
    assert manifest["files"] == artifacts["files"]
    for entry in manifest["files"]:  # every reported checksum is the bucket's object
        body = client.get_object(Bucket=BUCKET, Key=f"jobs/{job}/output/{entry['name']}")["Body"].read()
        assert (len(body), _sha256(body)) == (entry["bytes"], entry["sha256"]), entry["name"]
    # The job's own locations are recorded, not this pod's cache paths.
    config = _remote_json(client, f"jobs/{job}/output/training_config.json")
    assert config["model"]["path"] == f"s3://{BUCKET}/models/tiny" and config["output_dir"].startswith("s3://")
    adapter_config = _remote_json(client, f"jobs/{job}/output/adapter/adapter_config.json")
    assert adapter_config["base_model_name_or_path"] == f"s3://{BUCKET}/models/tiny"
    # The final adapter equals the last checkpoint's adapter (same training state).
    final = client.get_object(Bucket=BUCKET, Key=f"jobs/{job}/output/adapter/adapter_model.safetensors")["Body"].read()
    ckpt = client.get_object(Bucket=BUCKET, Key=f"jobs/{job}/checkpoints/step-10/adapter/adapter_model.safetensors")
    assert final == ckpt["Body"].read()


def test_sigterm_then_resume_on_a_fresh_pod_continues_the_same_losses(
    uninterrupted, bucket, s3_endpoint, tmp_path, monkeypatch
):
    from trainers.spec import TrainerSpec

    client, job = bucket["client"], "ftjob-s3resume"
    spec = TrainerSpec.model_validate(_spec_dict(job, tmp_path))
    first = _start(spec, tmp_path / "spec.json", s3_endpoint, tmp_path / "pod1")
    deadline = time.monotonic() + 180
    while not _keys(client, f"jobs/{job}/checkpoints/step-2/trainer_state.json"):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.02)
    first.send_signal(signal.SIGTERM)  # checkpoint now, upload it, exit PREEMPTED
    out, _ = first.communicate(timeout=120)
    assert first.returncode == ExitCode.PREEMPTED, out
    stopped = [r for r in _reports(tmp_path / "pod1", job) if r["type"] == "checkpoint"][-1]
    assert 2 <= stopped["step"] < 10
    assert stopped["location"] == f"s3://{BUCKET}/jobs/{job}/checkpoints/step-{stopped['step']}"

    # A new pod: an empty cache, so model, data and the checkpoint all come from the bucket.
    # In this process (the entry point's main(), the code `python -m trainers` runs) to
    # spare the suite a third interpreter start with torch imports.
    from trainers.__main__ import main

    for key, value in {**CREDS, "TUNEFLEET_S3_ENDPOINT_URL": s3_endpoint,
                       "TUNEFLEET_CACHE_DIR": str(tmp_path / "pod2")}.items():
        monkeypatch.setenv(key, value)
    assert main(["--spec", str(tmp_path / "spec.json")]) == ExitCode.SUCCESS
    reports = _reports(tmp_path / "pod2", job)
    assert any(r["type"] == "event" and r["message"] == f"resumed from step-{stopped['step']}" for r in reports)
    # It lists the checkpoint it resumed from again, from the bucket (not uploaded again),
    # with the rows since the periodic checkpoint before it, and did not start over.
    every = spec.checkpoint.every_n_steps
    since = stopped["step"] - (stopped["step"] - 1) % every - 1
    resumed_steps = [r["step"] for r in reports if r["type"] == "metric"]
    assert resumed_steps == list(range(since + 1, 11))
    relisted = next(r for r in reports if r["type"] == "checkpoint")
    assert (relisted["step"], relisted["location"]) == (stopped["step"], stopped["location"])

    reference = _remote_losses(client, uninterrupted["job"])
    resumed = _remote_losses(client, job)  # rows before the checkpoint come from pod 1
    assert sorted(resumed) == sorted(reference) == list(range(1, 11))
    for step in reference:
        assert abs(resumed[step] - reference[step]) <= 1e-6, (step, resumed[step], reference[step])


def test_a_failed_checkpoint_upload_fails_the_item_and_is_kept_for_the_entry_point(s3_env, bucket, make_spec, tmp_path):
    from trainers.common.checkpointing import TrainerState, save_checkpoint
    from trainers.common.data import DataCursor

    spec = _s3_spec(make_spec, "ftjob-nobucket", checkpoint={"dir": "s3://no-such-bucket/ckpt"})
    staging = S3Staging(spec)
    sent: list[dict] = []

    class Inner:
        def add(self, item: dict) -> None:
            sent.append(item)

    reporter = staging.wrap_reporter(Inner())
    path = save_checkpoint(staging.local_spec.checkpoint.dir, TrainerState(step=2, epoch=0, cursor=DataCursor()),
                           lambda d: (d / "w.bin").write_bytes(b"w"), keep_last=2)
    with pytest.raises(UserError) as err:
        reporter.checkpoint(2, str(path), {})
    assert err.value.code == "bucket_not_found" and reporter.failure is err.value
    assert sent == []  # never a checkpoint item that points at nothing
    reporter.add({"type": "event", "level": "info", "message": "m", "data": {}})  # other items pass unchanged
    assert sent == [{"type": "event", "level": "info", "message": "m", "data": {}}]
