"""The service in production mode on backends a test may break: for the fault tests.

``ProductionStack`` is what a production install runs, as separate processes the test
owns: a throwaway PostgreSQL (``initdb`` + ``pg_ctl`` on a free port), a throwaway
``redis-server`` (no persistence, so a restart comes back empty, as a crashed cache
does), and the API, a Celery worker and the scheduler loop
(``tests.e2e.conftest.Service``) with the local executor. Stopping either backend for
as long as a test likes never touches the shared PostgreSQL and Redis other tests use.

``ScratchDisk`` is a small tmpfs mounted over a directory (root only), so a test can fill
it to the last byte at the moment it chooses and see what the service does with a full
disk.

Job helpers (``submit``, ``finished``, ``metric_steps``, ...) talk to the API over HTTP
as a user would; ``pg_rows`` reads what only the database shows.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import REPO, _unavailable, free_port
from tests.e2e.conftest import CLI, ENSURE_ADMIN, Service
from tests.e2e.test_local_training import all_metrics, upload, wait_for
from tests.faults.test_redis_restart import REDIS_SERVER, ThrowawayRedis

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
PG_BINARIES = ("initdb", "pg_ctl")


class ThrowawayPostgres:
    """A PostgreSQL cluster of its own on ``port`` (trust auth, fsync off), stopped and
    started at will. As root the server runs as the ``postgres`` user (it refuses root)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.root = Path(tempfile.mkdtemp(prefix="tunefleet-pg-"))  # not under a 0700 pytest dir
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            self._as_user = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/tunefleet"

    def _run(self, *command: str) -> None:
        done = subprocess.run([*self._as_user, *command], check=False, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{command[0]} failed: {done.stdout}{done.stderr}\n{log}")

    def create(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                             autocommit=True) as admin:
            admin.execute("CREATE DATABASE tunefleet")

    def start(self) -> None:
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' "
                   "-c fsync=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")

    def stop(self) -> None:
        """Stop at once (``immediate``: every connection drops, as in a crash or failover)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def destroy(self) -> None:
        if self.running():
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class ScratchDisk:
    """A tmpfs of ``size_mib`` mounted over ``path``; ``fill()`` takes every free byte."""

    def __init__(self, path: Path, size_mib: int) -> None:
        self.path = path
        self.size_mib = size_mib
        self.mounted = False

        self.refused = ""

    def mount(self) -> bool:
        """Mount it; False (the reason in ``refused``) where this process may not mount."""
        self.path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mib}m,mode=0755", "tmpfs",
                               str(self.path)], check=False, capture_output=True, text=True)
        self.refused = "" if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")
        self.mounted = not self.refused
        return self.mounted

    def require(self) -> None:
        """Skip locally, fail under CI=true, when it could not be mounted."""
        if not self.mounted:
            _unavailable(f"a tmpfs mount over {self.path}", self.refused)

    @property
    def filler(self) -> Path:
        return self.path / ".filler"

    def fill(self) -> None:
        """Write one file until the kernel answers ENOSPC: no byte is free afterwards."""
        chunk = b"\0" * (1 << 20)
        with self.filler.open("ab", buffering=0) as fh:
            while True:
                try:
                    fh.write(chunk)
                except OSError:
                    break
        with self.filler.open("ab", buffering=0) as fh:  # the last partial page
            for size in (65536, 4096, 512, 1):
                try:
                    while True:
                        fh.write(b"\0" * size)
                except OSError:
                    continue
        assert shutil.disk_usage(self.path).free == 0, shutil.disk_usage(self.path)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)
            self.mounted = False


@dataclass
class ProductionStack:
    """PostgreSQL + Redis + API + worker + scheduler; see the module docstring."""

    postgres: ThrowawayPostgres
    redis: ThrowawayRedis
    service: Service
    disks: dict[str, ScratchDisk] = field(default_factory=dict)  # by the directory they cover

    @property
    def data_dir(self) -> Path:
        return self.service.data_dir

    def http(self) -> httpx.Client:
        """A client of the admin key."""
        return self.service.http()

    def tenant_http(self, name: str) -> httpx.Client:
        """A client of a new tenant's key: its jobs and webhooks are its own."""
        with self.http() as admin:
            tenant = admin.post("/admin/tenants", json={"name": f"{name}-{secrets.token_hex(3)}"})
            assert tenant.status_code == 200, tenant.text
            key = admin.post(f"/admin/tenants/{tenant.json()['id']}/api_keys", json={})
            assert key.status_code == 200, key.text
        return httpx.Client(base_url=f"{self.service.base_url}/v1", timeout=30.0,
                            headers={"Authorization": f"Bearer {key.json()['key']}"})

    def ensure_up(self) -> None:
        """Backends and every role running again (after a test that stopped one failed)."""
        if not self.postgres.running():
            self.postgres.start()
        if self.redis.proc is None or self.redis.proc.poll() is not None:
            self.redis.start()
        for role in ("api", "worker", "scheduler"):
            proc = self.service.procs.get(role)
            if proc is None or proc.poll() is not None:
                self.service.start(role)

    def supervisors_alive(self) -> dict[str, int | None]:
        """Each role's exit status (None: still running)."""
        return {role: proc.poll() for role, proc in self.service.procs.items()}

    def wait_ready(self, timeout: float = 60) -> None:
        """The worker consumes (its heartbeat is fresh): tasks sent now are run."""
        def ready() -> bool:
            try:
                return httpx.get(f"{self.service.base_url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout, f"/readyz\n{self.service.dump_logs()}")


def require_backend_binaries() -> None:
    missing = [name for name in PG_BINARIES if shutil.which(name) is None]
    if REDIS_SERVER is None:
        missing.append("redis-server")
    if missing:
        _unavailable(f"{', '.join(missing)} (for throwaway backends)", "not installed")


@contextmanager
def production_stack(root: Path, tiny_model_dir: Path, *, before_start: Callable[[Path], None] | None = None,
                     **extra_env: Any) -> Iterator[ProductionStack]:
    """Start the stack under ``root``; ``before_start(data_dir)`` runs before any role."""
    require_backend_binaries()
    postgres = ThrowawayPostgres(free_port())
    redis_server = ThrowawayRedis(free_port(), root / "redis.log")
    data_dir = root / "data"
    (data_dir / "models").mkdir(parents=True)
    os.symlink(tiny_model_dir, data_dir / "models" / "tiny-llama")
    if before_start is not None:
        before_start(data_dir)
    port = free_port()
    admin_key = f"tf_{secrets.token_hex(4)}_{secrets.token_hex(16)}"
    try:
        postgres.create()
        redis_server.start()
        env = {
            **os.environ,
            "TUNEFLEET_ENV": "test",
            "TUNEFLEET_DATA_DIR": str(data_dir),
            "TUNEFLEET_PUBLIC_URL": f"http://127.0.0.1:{port}",
            "TUNEFLEET_ADMIN_API_KEY": admin_key,
            "TUNEFLEET_DATABASE_URL": postgres.url,
            "TUNEFLEET_BROKER_URL": f"redis://127.0.0.1:{redis_server.port}/0",
            "TUNEFLEET_SCHEDULE_INTERVAL_S": "0.5",
            "TUNEFLEET_STOP_GRACE_S": "20",
            "TUNEFLEET_RESTART_BACKOFF_S": "1",  # not the default's 10 s: tests about the backoff set their own
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **{k: str(v) for k, v in extra_env.items()},
        }
        for command in ([*CLI, "db", "upgrade"], ENSURE_ADMIN):
            subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
        service = Service(base_url=f"http://127.0.0.1:{port}", data_dir=data_dir, env=env, admin_key=admin_key)
        stack = ProductionStack(postgres, redis_server, service)
        for role in ("api", "worker", "scheduler"):
            service.start(role)
        stack.wait_ready()
        yield stack
    finally:
        if "service" in locals():
            for role in list(service.procs):
                service.stop(role)
        redis_server.stop()
        postgres.destroy()


# ---- jobs over HTTP ----------------------------------------------------------------------


def submit(http: httpx.Client, file_id: str, *, trainer: str = "fsdp_qlora", n_epochs: int = 2,
           batch_size: int = 4, seed: int = 11, **extra: Any) -> str:
    """A small LoRA job on the tiny model (4 steps per epoch of 16 examples); its id."""
    resp = http.post("/fine_tuning/jobs", json={
        "model": "tunefleet-tiny-llama", "training_file": file_id, "seed": seed, "trainer": trainer,
        "hyperparameters": {"n_epochs": n_epochs, "batch_size": batch_size, "learning_rate_multiplier": 20.0},
        "adapter": {"method": "lora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "max_seq_len": 48, **extra,
    })
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def upload_examples(http: httpx.Client, n: int = 16, seed: int = 3) -> str:
    from tunefleet.demo import demo_examples

    return upload(http, demo_examples(n, seed=seed))


def job(http: httpx.Client, job_id: str) -> dict[str, Any]:
    resp = http.get(f"/fine_tuning/jobs/{job_id}")
    assert resp.status_code == 200, resp.text
    return resp.json()


def finished(http: httpx.Client, job_id: str, timeout: float = 240) -> dict[str, Any]:
    """The job once terminal (fails with the service's logs after ``timeout``)."""
    def done() -> dict[str, Any] | None:
        try:
            current = job(http, job_id)
        except httpx.HTTPError:
            return None
        return current if current["status"] in TERMINAL else None

    return wait_for(done, timeout, f"job {job_id} to end")


def events(http: httpx.Client, job_id: str) -> list[str]:
    """Event messages, oldest first."""
    data = http.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    return [e["message"] for e in reversed(data)]


def losses(http: httpx.Client, job_id: str) -> dict[int, float]:
    return {row["step"]: row["train_loss"] for row in all_metrics(http, job_id)}


def output_metric_steps(data_dir: Path, job_id: str) -> list[int]:
    """Steps of the job's ``metrics.jsonl`` output, in file order (each must appear once)."""
    path = data_dir / "artifacts" / job_id / "output" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def pg_rows(stack: ProductionStack, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(f"host=127.0.0.1 port={stack.postgres.port} user=postgres dbname=tunefleet",
                         connect_timeout=5) as db:
        return list(db.execute(sql, params).fetchall())


def trainer_pid(data_dir: Path, job_id: str) -> int | None:
    try:
        return int((data_dir / "jobs" / job_id / "trainer.pid").read_text())
    except (FileNotFoundError, ValueError):
        return None


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    return wait_for(predicate, timeout, what, interval=interval)


def stop_trainer_when(data_dir: Path, job_id: str, reached: Callable[[], bool], what: str,
                      timeout: float = 300) -> int:
    """Leave the job's trainer (its process group) SIGSTOPped once ``reached()`` holds;
    returns its pid. The trainer runs in 10 ms bursts and ``reached`` is read while it is
    stopped: the tiny jobs' steps take milliseconds on a fast CPU, so a test process that
    waited for a core while the trainer ran freely saw the moment it waited for only after
    the last step."""
    pid = wait_until(lambda: trainer_pid(data_dir, job_id), timeout, f"the trainer of {job_id}")

    def stopped_there() -> bool:
        try:
            os.killpg(pid, signal.SIGSTOP)
        except ProcessLookupError:
            raise AssertionError(f"the trainer of {job_id} ended before {what}") from None
        if reached():
            return True
        os.killpg(pid, signal.SIGCONT)
        return False

    wait_until(stopped_there, timeout, what, interval=0.01)
    return pid


def step_reached(http: httpx.Client, job_id: str, step: int) -> Callable[[], bool]:
    def reached() -> bool:
        try:
            return (job(http, job_id).get("current_step") or 0) >= step
        except httpx.HTTPError:
            return False
    return reached


def sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))
