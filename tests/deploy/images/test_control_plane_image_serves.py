"""The control-plane image runs the service: migrations, the API, the Celery worker and the
scheduler, each a program of the image on this machine's PostgreSQL and Redis, with the
production settings' guard on.

Each runs as the chart runs it: the image's user on a read-only root, with an emptyDir at
/tmp and, for the API, at its metrics folder. The three share the image's data volume
(``/var/lib/tunefleet``: the local artifact store, as docker-compose.yml mounts it) and
use the local executor, so the run needs no Kubernetes API server nor object store. Through
the API a file is uploaded (the worker validates it) and a job created on it (the scheduler
places it and the executor writes its spec), then cancelled: the control plane holds no
trainer framework, its trainers run from the trainer images
(test_trainer_images_train.py).
"""

from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.conftest import PG_ADMIN_DSN, free_port
from tests.deploy.images.container import Image, Mount, Process
from tests.model_files import install_demo_model
from tunefleet.demo import DEMO_MODEL_ID, demo_examples

DATA_DIR = "/var/lib/tunefleet"
METRICS_DIR = "/var/run/tunefleet-metrics"


@pytest.fixture
def database() -> Iterator[str]:
    """A new, empty PostgreSQL database of this test's own: the migrations create its schema."""
    import psycopg

    name = f"tunefleet_images_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def wait_for(what: str, check: Callable[[], Any], timeout: float, processes: list[Process]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        dead = [p for p in processes if not p.alive()]
        assert not dead, f"{[p.name for p in dead]} exited while waiting for {what}\n" + "\n".join(
            p.tail() for p in processes)
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(p.tail() for p in processes))


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_control_plane_image_migrates_serves_validates_and_schedules(api_image: Image, database, redis_url,
                                                                       tmp_path):
    data = tmp_path / "data"
    install_demo_model(data / "models")  # the demo model's files, as `tunefleet serve` makes them
    uid, gid = api_image.user
    for path in (data, *data.rglob("*")):
        os.chown(path, uid, gid)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    admin_key = f"tf_{secrets.token_hex(4)}_{secrets.token_hex(16)}"
    env = {
        "TUNEFLEET_ENV": "production",
        "TUNEFLEET_DATABASE_URL": database,
        "TUNEFLEET_BROKER_URL": redis_url,
        "TUNEFLEET_SECRET_KEY": secrets.token_urlsafe(48),
        "TUNEFLEET_ADMIN_API_KEY": admin_key,
        "TUNEFLEET_METRICS_TOKEN": secrets.token_urlsafe(24),
        "TUNEFLEET_PUBLIC_URL": url,
        # a plain-http loopback URL: allowed explicitly, as an operator whose TLS ends in front does
        "TUNEFLEET_ALLOW_HTTP_PUBLIC_URL": "true",
        "TUNEFLEET_EXECUTOR": "local",
        "OMP_NUM_THREADS": "1",
    }
    volumes = [Mount("/tmp"), Mount(DATA_DIR, data)]

    migrate = api_image.run(["tunefleet", "db", "upgrade"], volumes, env)
    assert migrate.returncode == 0, migrate.stdout + migrate.stderr

    command = [*api_image.config["Cmd"]]
    command = [f"--port={port}" if arg.startswith("--port=") else arg for arg in command]
    processes = [
        api_image.start(command, tmp_path / "api.log", [*volumes, Mount(METRICS_DIR)],
                        {**env, "PROMETHEUS_MULTIPROC_DIR": METRICS_DIR}),
        api_image.start(["tunefleet", "worker", "--concurrency=1"], tmp_path / "worker.log", volumes,
                        {**env, "TUNEFLEET_METRICS_PORT": str(free_port())}),
        api_image.start(["tunefleet", "scheduler"], tmp_path / "scheduler.log", volumes,
                        {**env, "TUNEFLEET_METRICS_PORT": str(free_port()), "TUNEFLEET_SCHEDULE_INTERVAL_S": "1"}),
    ]
    try:
        wait_for("the API to be ready (database and broker)", lambda: _ready(url), 90, processes)
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        oai = OpenAI(api_key=admin_key, base_url=f"{url}/v1", max_retries=0, timeout=30.0)

        body = "".join(json.dumps(e) + "\n" for e in demo_examples()[:16]).encode()
        uploaded = oai.files.create(file=("train.jsonl", io.BytesIO(body)), purpose="fine-tune")
        status = wait_for("the worker to validate the file",
                          lambda: oai.files.retrieve(uploaded.id).status != "uploaded" and
                          oai.files.retrieve(uploaded.id).status, 90, processes)
        assert status == "processed"

        job = oai.fine_tuning.jobs.create(model=DEMO_MODEL_ID, training_file=uploaded.id,
                                          hyperparameters={"n_epochs": 1, "batch_size": 4})
        placed = wait_for("the scheduler to place the job",
                          lambda: (j := oai.fine_tuning.jobs.retrieve(job.id)).status != "queued" and j, 90,
                          processes)
        assert placed.status == "running", placed
        spec = json.loads((data / "jobs" / job.id / "spec.json").read_text())  # the local executor's
        assert spec["job_id"] == job.id and spec["model"]["path"] == f"{DATA_DIR}/models/tiny-llama"

        assert oai.fine_tuning.jobs.cancel(job.id).status == "cancelled"
        for process in processes:
            assert process.alive(), process.tail()
    finally:
        for process in processes:
            process.stop()
        shutil.rmtree(data, ignore_errors=True)
