"""One real job through the service (API, worker, scheduler as processes; the real trainer)
checked for several findings at once, so the suite pays for one training run:

- the trainer checks a job's MLflow ``tracking_uri`` before connecting: a loopback
  listener is never hit, and the job's events carry no text from the failure;
- a local trainer gets a minimal environment (no secret key, admin key, database URL);
- the spec (holding the job token) and the SQLite database are readable by their owner only;
- so is every file the trainer and the local executor wrote for the job (checkpoints'
  ``dcp/*.distcp``, ``trainer.log``, ``metrics.jsonl``, ``training_config.json``, the
  adapter), in directories only their owner can enter.
"""

from __future__ import annotations

import stat
import time
from pathlib import Path

from sqlalchemy import update

from tests.security.listener import Listener


def _mlflow(uri: str) -> list[dict]:
    return [{"type": "mlflow", "mlflow": {"tracking_uri": uri, "experiment": "x"}}]


def _trainer_environ(job_dir: Path, is_done, timeout: float = 240) -> dict[str, str]:
    """The environment of the job's trainer process, read from /proc while it runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not is_done():
        try:
            pid = int((job_dir / "trainer.pid").read_text())
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except (FileNotFoundError, ValueError, ProcessLookupError):
            time.sleep(0.05)
            continue
        if raw:
            return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    raise AssertionError("the trainer ended before its environment could be read")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_real_job_keeps_tenant_trackers_secrets_and_files_confined(service) -> None:
    from control.db.models import Job
    from control.db.session import session_scope
    from tests.e2e.test_local_training import TERMINAL, upload, wait_status
    from tunefleet.demo import demo_examples

    svc = service()
    svc.stop("scheduler")  # nothing is admitted while the row is changed
    with Listener() as listener, svc.http() as http:
        file_id = upload(http, demo_examples(16, seed=3))
        created = http.post("/fine_tuning/jobs", json={
            "model": "tunefleet-tiny-llama", "training_file": file_id,
            "hyperparameters": {"n_epochs": 1, "batch_size": 8}})
        assert created.status_code == 200, created.text
        job_id = created.json()["id"]
        # A row naming a loopback tracker: stored before the creation check existed, or a
        # name that resolved elsewhere when the job was created.
        with session_scope(svc.env["TUNEFLEET_DATABASE_URL"]) as session:
            session.execute(update(Job).where(Job.id == job_id).values(
                integrations=_mlflow(f"{listener.url}/mlflow")))
        svc.start("scheduler")
        job_dir = svc.data_dir / "jobs" / job_id

        def is_done() -> bool:
            return http.get(f"/fine_tuning/jobs/{job_id}").json()["status"] in TERMINAL

        trainer_env = _trainer_environ(job_dir, is_done)
        job = wait_status(http, job_id, TERMINAL)
        assert job["status"] == "succeeded", svc.dump_logs()
        events = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]

    assert listener.hits == []
    messages = [e["message"] for e in events]
    assert "mlflow integration not started (TargetURLError); the trainer log has the details" in messages
    assert not any("127.0.0.1" in m or "internal service answer" in m for m in messages), messages
    assert "TargetURLError" in (job_dir / "trainer.log").read_text()

    for leaked in ("TUNEFLEET_ADMIN_API_KEY", "TUNEFLEET_DATABASE_URL", "TUNEFLEET_BROKER_URL",
                   "TUNEFLEET_PUBLIC_URL", "TUNEFLEET_DATA_DIR"):
        assert leaked not in trainer_env, leaked
    assert svc.admin_key not in "\0".join(trainer_env.values())
    assert trainer_env["OMP_NUM_THREADS"] == "1" and "PATH" in trainer_env

    assert _mode(job_dir / "spec.json") == 0o600
    assert _mode(svc.data_dir / "tunefleet.db") == 0o600
    output = svc.data_dir / "artifacts" / job_id
    written = {p.relative_to(svc.data_dir).as_posix(): _mode(p) for p in [job_dir, output, *job_dir.rglob("*"),
                                                                       *output.rglob("*")]}
    for name in ("trainer.log", "output/metrics.jsonl", "output/training_config.json",
                 "output/adapter/adapter_model.safetensors"):
        assert any(path.endswith(name) for path in written), (name, sorted(written))
    assert any(path.endswith(".distcp") and "/dcp/" in path for path in written), sorted(written)
    exposed = {path: oct(mode) for path, mode in written.items()
               if mode != (0o700 if (svc.data_dir / path).is_dir() else 0o600)}
    assert exposed == {}
