"""A trainer killed (SIGKILL) right after reporting a checkpoint loses no report.

The real reporter in a subprocess reports metric steps 1-5 and a checkpoint at step 5,
then kills itself at once, well inside the reporter's 2 s flush interval, as a node
failure or an OOM kill would. A second reporter on the same spool directory (the resumed
run's) reports step 6 and closes. The real report route must then hold every step and
list the checkpoint.
"""

from __future__ import annotations

import json
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
