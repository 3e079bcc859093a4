"""A trainer killed (SIGKILL) right after a checkpoint loses no report.

- The real reporter in a subprocess reports metric steps 1-5 and a checkpoint at step 5,
  then kills itself at once, well inside the reporter's 2 s flush interval, as a node
  failure or an OOM kill would. A second reporter on the same spool directory (the resumed
  run's) reports step 6 and closes. The real report route must then hold every step and
  list the checkpoint.
- The real trainer (``python -m trainers``, each trainer family) killed the instant its
  checkpoint ``step-4/`` is renamed into place, before anything else runs: the next run
  resumes from that checkpoint and never produces steps 3-4 again, so their metrics and
  the checkpoint's listing must come from what the first run left on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.conftest import start_running
from tests.conftest import REPO

KILLED_TRAINER = """
import json, os, signal, sys
from trainers.common.reporter import Reporter

url, token, spool, location = sys.argv[1:5]
reporter = Reporter(url=url, token=token, spool_dir=spool, flush_interval_s=2.0)
for step in range(1, 6):
    reporter.metric(step=step, total_steps=10, train_loss=2.0 - step / 10)
reporter.checkpoint(5, location, {"train_loss": 1.5})
os.kill(os.getpid(), signal.SIGKILL)  # before the next flush tick
"""


@pytest.fixture
def backend() -> str:
    return "sqlite"  # the reporter's durability does not depend on the database


def test_a_kill_right_after_a_checkpoint_loses_no_report(
    app, client, live_server, make_job, tenant_key, db_session, settings, tmp_path: Path
) -> None:
    from trainers.common.reporter import Reporter

    key = tenant_key()
    job = make_job(key.headers)
    _, token = start_running(db_session, job["id"])
    url = f"{live_server(app)}/internal/v1/jobs/{job['id']}/reports"
    spool = settings.job_dir(job["id"]) / "spool"
    location = settings.job_dir(job["id"]) / "checkpoints" / "step-5"
    location.mkdir(parents=True)

    killed = subprocess.run(
        [sys.executable, "-c", KILLED_TRAINER, url, token, str(spool), str(location)],
        cwd=REPO, capture_output=True, timeout=60, check=False,  # it dies by SIGKILL
    )
    assert killed.returncode == -9, killed.stderr.decode()

    resumed = Reporter(url=url, token=token, spool_dir=spool, flush_interval_s=0.05)
    resumed.metric(step=6, total_steps=10, train_loss=1.4)
    assert resumed.close(timeout_s=20), resumed.rejected

    metrics = client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics", headers=key.headers).json()
    assert [m["step"] for m in metrics["data"]] == [1, 2, 3, 4, 5, 6]
    checkpoints = client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints",
                             headers=key.headers).json()
    assert [c["step_number"] for c in checkpoints["data"]] == [5], json.dumps(checkpoints)


# The trainer's entry point with os.replace wrapped: the rename that makes checkpoint
# argv[2] visible is the last thing the process does.
KILLED_AT_THE_RENAME = """
import os, signal, sys
from pathlib import Path
rename = os.replace
def replace(src, dst, *args, **kwargs):
    rename(src, dst, *args, **kwargs)
    if Path(dst).name == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
from trainers.__main__ import main
sys.exit(main(["--spec", sys.argv[1]]))
"""
STEPS, EVERY, KILLED_AT = 6, 2, 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tunefleet.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("models"))


def _trainer_spec(trainer: str, job_id: str, token: str, url: str, settings, model: Path, tmp_path: Path) -> Path:
    from trainers.spec import TrainerSpec
    from tunefleet.demo import write_demo_dataset

    job_dir = settings.job_dir(job_id)
    spec = TrainerSpec.model_validate({
        "job_id": job_id, "trainer": trainer, "model": {"path": str(model)},
        "data": {"train_file": str(write_demo_dataset(tmp_path / "train.jsonl", 16, seed=4)), "format": "chat",
                 "max_seq_len": 48},
        "hyperparameters": {"n_epochs": 1, "batch_size": 2, "micro_batch_size": 2, "learning_rate": 1e-3,
                            "max_steps": STEPS},
        "adapter": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]},
        "output_dir": str(Path(settings.resolved_artifact_url) / job_id / "output"),
        "checkpoint": {"dir": str(job_dir / "checkpoints"), "every_n_steps": EVERY, "keep_last": 1,
                       "resume_from": "latest"},
        "report": {"url": url, "token": token, "spool_dir": str(job_dir / "spool")},
        "termination_log": str(job_dir / "termination.json"), "seed": 3,
        **({"parallelism": {"host_devices": 1}} if trainer == "jax_lora" else {}),
    })
    job_dir.mkdir(parents=True, exist_ok=True)
    spec.dump(job_dir / "spec.json")
    return job_dir / "spec.json"


@pytest.mark.parametrize("trainer", ["fsdp_qlora", "jax_lora"])
def test_a_trainer_killed_the_instant_its_checkpoint_is_renamed_loses_no_report(
    app, client, live_server, make_job, tenant_key, db_session, settings, tiny_model, tmp_path: Path, trainer: str
) -> None:
    key = tenant_key()
    job = make_job(key.headers)
    _, token = start_running(db_session, job["id"])
    spec = _trainer_spec(trainer, job["id"], token, f"{live_server(app)}/internal/v1/jobs/{job['id']}/reports",
                         settings, tiny_model, tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    killed = subprocess.run([sys.executable, "-c", KILLED_AT_THE_RENAME, str(spec), f"step-{KILLED_AT}"],
                            cwd=REPO, env=env, capture_output=True, timeout=300, check=False)
    assert killed.returncode == -9, killed.stderr.decode()[-3000:]
    resumed = subprocess.run([sys.executable, "-m", "trainers", "--spec", str(spec)],
                             cwd=REPO, env=env, capture_output=True, timeout=300, check=False)
    assert resumed.returncode == 0, resumed.stderr.decode()[-3000:]

    metrics = client.get(f"/v1/fine_tuning/jobs/{job['id']}/metrics", headers=key.headers).json()
    assert [m["step"] for m in metrics["data"]] == list(range(1, STEPS + 1))
    checkpoints = client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints", headers=key.headers).json()
    assert sorted(c["step_number"] for c in checkpoints["data"]) == list(range(EVERY, STEPS + 1, EVERY))
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=key.headers,
                        params={"limit": 100}).json()["data"]
    created = [e["message"] for e in events if e["message"].startswith("Checkpoint created")]
    assert sorted(created) == sorted(f"Checkpoint created at step {n}" for n in range(EVERY, STEPS + 1, EVERY))
