"""MLflow (local file store, no server) and W&B (offline) mirroring of report items.

The trackers are read back with their own clients and formats, not with our code:
MLflow's ``MlflowClient.get_metric_history`` / ``download_artifacts``; for W&B, the
offline run's transaction log (``run-<id>.wandb``: LevelDB log framing of wandb's own
protobuf ``Record`` messages, decoded with ``wandb.proto``).

MLflow 3 refuses its ``file:`` store unless ``MLFLOW_ALLOW_FILE_STORE=true`` ("maintenance
mode"); its SQLite store works too but spends ~8 s creating tables per test, so the
tests opt into the file store.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainers.common.integrations import TrackerMirror, mirror_from_spec
from trainers.spec import TrainerSpec

LOSSES = [2.5, 2.1, 1.75, 1.5]


def make_spec(tmp_path: Path, integrations: list[dict]) -> TrainerSpec:
    return TrainerSpec.model_validate({
        "job_id": "ftjob-test123", "trainer": "fsdp_qlora",
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_file": str(tmp_path / "train.jsonl"), "format": "chat", "max_seq_len": 64},
        "hyperparameters": {"n_epochs": 1, "batch_size": 2, "micro_batch_size": 1, "learning_rate": 1e-3},
        "output_dir": str(tmp_path / "out"), "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "integrations": integrations,
    })


def write_adapter(out: Path) -> dict[str, str]:
    adapter = out / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (adapter / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 8)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in adapter.iterdir()}


def feed(mirror: TrackerMirror, out: Path) -> None:
    for step, loss in enumerate(LOSSES, start=1):
        mirror.add({"type": "metric", "step": step, "total_steps": len(LOSSES), "train_loss": loss,
                    "learning_rate": 1e-3, "tokens_per_s": 1000.0 + step, "valid_loss": None, "time": 1.7e9 + step})
    mirror.add({"type": "event", "level": "info", "message": "done", "data": {}})
    mirror.add({"type": "artifacts", "location": str(out), "files": []})


def mirror_without_warnings(spec: TrainerSpec, out: Path, tracker: str) -> None:
    """Mirror the job whose outputs are in ``out`` to ``tracker``, the one tracker ``spec``
    names, through the whole run (``feed``); it must start and finish without a warning."""
    warnings: list[str] = []
    mirror = mirror_from_spec(spec, warn=warnings.append)
    assert mirror is not None and [t.name for t in mirror.trackers] == [tracker], warnings
    feed(mirror, out)
    mirror.close()
    assert warnings == []


def local_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A file store as the operator's tracking server (``MLFLOW_TRACKING_URI``): a job's own
    ``tracking_uri`` may only name a public http(s) server."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def test_mlflow_run_has_metrics_params_and_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    uri = local_mlflow(tmp_path, monkeypatch)
    spec = make_spec(tmp_path, [{"type": "mlflow", "project": "exp-a", "name": "run-a"}])
    digests = write_adapter(tmp_path / "out")
    mirror_without_warnings(spec, tmp_path / "out", "mlflow")

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("exp-a")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "run-a"
    assert run.info.status == "FINISHED"
    assert run.data.tags["tunefleet.job_id"] == "ftjob-test123"
    assert run.data.params["lora_r"] == "8" and run.data.params["learning_rate"] == "0.001"
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == list(enumerate(LOSSES, start=1))
    assert "valid_loss" not in run.data.metrics  # None values are not invented as metrics
    local = Path(client.download_artifacts(run.info.run_id, "adapter", str(tmp_path / "dl")))
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in local.iterdir()}
    assert got == digests


def test_restarted_trainer_continues_the_same_mlflow_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    uri = local_mlflow(tmp_path, monkeypatch)
    spec = make_spec(tmp_path, [{"type": "mlflow"}])
    for steps in ((1, 2), (3, 4)):  # the second process resumes after a preemption
        mirror = mirror_from_spec(spec)
        assert mirror is not None and mirror.trackers
        for step in steps:
            mirror.add({"type": "metric", "step": step, "train_loss": LOSSES[step - 1]})
        mirror.close()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tunefleet").experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id, "train_loss"), key=lambda m: m.step)
    assert [m.value for m in history] == LOSSES and run.info.status == "FINISHED"


def test_error_item_marks_mlflow_run_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    uri = local_mlflow(tmp_path, monkeypatch)
    mirror = mirror_from_spec(make_spec(tmp_path, [{"type": "mlflow"}]))
    assert mirror is not None
    mirror.add({"type": "error", "code": "nan_loss", "message": "loss is NaN"})
    mirror.close()
    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("tunefleet").experiment_id])[0]
    assert run.info.status == "FAILED"


def test_broken_tracker_is_switched_off_without_raising(tmp_path: Path) -> None:
    class Exploding:
        name = "boom"

        def log_metrics(self, *a: object) -> None:
            raise RuntimeError("server down")

        def log_adapter(self, *a: object) -> None:  # pragma: no cover - never reached
            raise AssertionError

        def finish(self, failed: bool) -> None:  # pragma: no cover - never reached
            raise AssertionError

    warnings: list[str] = []
    mirror = TrackerMirror([Exploding()], warn=warnings.append)
    mirror.add({"type": "metric", "step": 1, "train_loss": 1.0})
    mirror.add({"type": "metric", "step": 2, "train_loss": 0.5})
    mirror.close()
    assert mirror.trackers == []
    assert warnings == ["boom mirroring stopped (RuntimeError); the trainer log has the details"]


def test_unknown_tracking_server_is_a_warning_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    warnings: list[str] = []
    spec = make_spec(tmp_path, [{"type": "mlflow"}])  # no tracking_uri and no env
    mirror = mirror_from_spec(spec, warn=warnings.append)
    assert mirror is not None and mirror.trackers == []
    assert warnings == ["mlflow integration not started (ValueError); the trainer log has the details"]


def wandb_records(path: Path) -> Iterator[Any]:
    """Records of an offline run file: a 7-byte header (':W&B', magic, version), then
    LevelDB log records (crc32, length, type) in 32 KiB blocks, each a protobuf Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_has_metrics_and_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb  # noqa: F401 (a dev dependency: the test fails, not skips, without it)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = make_spec(tmp_path, [{"type": "wandb", "project": "proj-b", "name": "run-b"}])
    adapter_dir = tmp_path / "out" / "adapter"
    write_adapter(tmp_path / "out")
    mirror_without_warnings(spec, tmp_path / "out", "wandb")
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb-core (a separate process) may still be writing the log when finish() returns:
    # wait for its `exit` record, which it writes last.
    deadline = time.monotonic() + 20
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(run_file)):
        assert time.monotonic() < deadline, "wandb never wrote the exit record"
        time.sleep(0.1)
    history, artifacts, exit_codes, config, runs, kinds = [], [], [], {}, [], []
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        kinds.append(kind)
        if kind == "run":
            runs.append(record.run)
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            history.append(row)
        elif kind == "artifact":
            artifacts.append(record.artifact)
        elif kind == "exit":
            exit_codes.append(record.exit.exit_code)
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    assert [(r["_step"], r["train_loss"]) for r in history] == list(enumerate(LOSSES, start=1)), kinds
    assert [r["tokens_per_s"] for r in history] == [1001.0, 1002.0, 1003.0, 1004.0]
    assert "valid_loss" not in history[0]
    assert exit_codes == [0]
    assert runs[0].project == "proj-b" and runs[0].display_name == "run-b"
    assert config["job_id"] == "ftjob-test123" and config["lora_r"] == 8
    (artifact,) = artifacts
    assert artifact.type == "model" and artifact.name == "ftjob-test123-adapter"
    md5 = {p.name: base64.b64encode(hashlib.md5(p.read_bytes()).digest()).decode() for p in adapter_dir.iterdir()}
    assert {e.path: e.digest for e in artifact.manifest.contents} == md5


def test_a_slow_tracker_does_not_block_the_training_loop() -> None:
    import threading

    class Slow:
        name = "slow"

        def __init__(self) -> None:
            self.release = threading.Event()
            self.entered = threading.Event()
            self.logged: list[int] = []

        def log_metrics(self, step: int, metrics: dict, ts: int | None) -> None:
            self.entered.set()
            self.release.wait(10)  # a tracking server that hangs
            self.logged.append(step)

        def log_adapter(self, adapter_dir: Path) -> None:  # pragma: no cover - not used here
            raise AssertionError

        def finish(self, failed: bool) -> None:
            self.finished = failed

    slow = Slow()
    mirror = TrackerMirror([slow])
    mirror.add({"type": "metric", "step": 1, "train_loss": 1.0})
    mirror.add({"type": "metric", "step": 2, "train_loss": 0.5})  # returns while step 1 hangs
    assert slow.entered.wait(5) and slow.logged == []
    slow.release.set()
    mirror.close()
    assert slow.logged == [1, 2] and slow.finished is False
