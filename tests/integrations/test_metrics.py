"""``/metrics`` scraped from the running service and parsed with prometheus_client's parser."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO
from tests.sdk.conftest import DEMO_MODEL, JobDriver, Service, chat_jsonl
from tunefleet import NotFoundError, Tunefleet


def scrape(base_url: str, **headers: str) -> dict[str, list[Any]]:
    response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    families: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(response.text):
        families.setdefault(family.name, []).extend(family.samples)
    return families


def value(families: dict[str, list[Any]], name: str, **labels: str) -> float:
    """The value of sample ``name`` (e.g. ``x_count`` of histogram family ``x``) with ``labels``."""
    samples = [s for family in families.values() for s in family if s.name == name]
    for sample in samples:
        if all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    raise KeyError(f"{name}{labels} not in {samples}")


@pytest.fixture
def settings(settings: Any) -> Any:
    """The suite's settings with the files of the demo model the registry lists, as
    ``tunefleet serve`` builds them: jobs on it are estimated from its real config."""
    from tests.model_files import install_demo_model

    install_demo_model(settings.models_dir)
    return settings


@pytest.fixture
def capacity() -> Iterator[None]:
    from control.observability.collectors import set_pool_capacity_provider

    set_pool_capacity_provider(lambda: {"local": 4, "mi300x": 8})
    yield
    set_pool_capacity_provider(None)


@pytest.fixture
def scrape_token(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A metrics token, as production requires one: the per-job series are then served."""
    monkeypatch.setenv("TUNEFLEET_METRICS_TOKEN", "scrape-secret")
    return {"authorization": "Bearer scrape-secret"}


def test_metrics_reflect_jobs_queue_gpus_trainers_and_requests(service: Service, capacity: None,
                                                               scrape_token: dict[str, str]) -> None:
    with Tunefleet(base_url=service.base_url, api_key=service.key) as client:
        fid = client.files.upload(chat_jsonl(), filename="t.jsonl", wait=True).id
        queued = client.jobs.create(model=DEMO_MODEL, training_file=fid)
        running = client.jobs.create(model=DEMO_MODEL, training_file=fid)
        done = client.jobs.create(model=DEMO_MODEL, training_file=fid)
        client.jobs.retrieve(queued.id)
        with pytest.raises(NotFoundError):
            client.jobs.retrieve("ftjob-nope")
    driver = JobDriver(service, running.id)
    driver.start(pool="local", gpus=2)
    driver.report(driver.metric(1, 10, 2.5, tokens_per_s=900.0), driver.metric(2, 10, 1.25, tokens_per_s=1500.0))
    finisher = JobDriver(service, done.id)
    finisher.start(pool="local", gpus=1)
    finisher.finish("succeeded")

    m = scrape(service.base_url, **scrape_token)
    assert value(m, "tunefleet_metrics_database_up") == 1
    assert value(m, "tunefleet_jobs", status="queued", pool="none") == 1
    assert value(m, "tunefleet_jobs", status="running", pool="local") == 1
    assert value(m, "tunefleet_jobs", status="succeeded", pool="local") == 1
    assert value(m, "tunefleet_queue_depth", pool="any") == 1
    assert value(m, "tunefleet_queue_depth", pool="local") == 0
    assert value(m, "tunefleet_queue_oldest_wait_seconds", pool="any") >= 0
    assert value(m, "tunefleet_gpus_allocated", pool="local") == 2
    assert value(m, "tunefleet_gpus_total", pool="local") == 4
    assert value(m, "tunefleet_gpus_free", pool="local") == 2
    assert value(m, "tunefleet_gpus_free", pool="mi300x") == 8
    # Only the newest step of each RUNNING job.
    assert value(m, "tunefleet_job_tokens_per_second", job_id=running.id, pool="local") == 1500.0
    assert value(m, "tunefleet_job_train_loss", job_id=running.id) == 1.25
    assert value(m, "tunefleet_job_step", job_id=running.id) == 2
    assert value(m, "tunefleet_job_total_steps", job_id=running.id) == 10
    assert all(s.labels["job_id"] != done.id for s in m["tunefleet_job_step"])
    assert value(m, "tunefleet_webhook_deliveries", status="failed") == 0

    # Latency histogram: route templates as labels, never raw ids.
    latency = m["tunefleet_http_request_duration_seconds"]
    routes = {s.labels["route"] for s in latency}
    assert "/v1/fine_tuning/jobs/{job_id}" in routes and "/v1/files" in routes
    assert not any(running.id in r or queued.id in r for r in routes)
    count = value(m, "tunefleet_http_request_duration_seconds_count", method="GET",
                  route="/v1/fine_tuning/jobs/{job_id}", status="404")
    assert count >= 1


def test_pool_throughput_gauges_average_the_running_jobs_latest_steps(service: Service,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Per pool, the mean of its running jobs' latest tokens/s and MFU; served without a
    token too, as they name no job."""
    with Tunefleet(base_url=service.base_url, api_key=service.key) as client:
        fid = client.files.upload(chat_jsonl(), filename="t.jsonl", wait=True).id
        ids = [client.jobs.create(model=DEMO_MODEL, training_file=fid).id for _ in range(4)]
    # 6e9 FLOPs per token on 2 devices of 1 PFLOP/s: 100k tok/s is an MFU of 0.3.
    basis = {"model_flops_per_token": 6e9, "peak_flops": 2e15}
    fast, slow, unplanned, done = (JobDriver(service, job_id) for job_id in ids)
    fast.start(pool="mi300x", gpus=2, throughput=basis)
    fast.report(fast.metric(1, 10, 2.0, tokens_per_s=50_000.0), fast.metric(2, 10, 1.9, tokens_per_s=150_000.0))
    slow.start(pool="mi300x", gpus=2, throughput=basis)
    slow.report(slow.metric(1, 10, 2.0, tokens_per_s=100_000.0))
    # A job without a basis counts in the pool's tokens/s, not in its MFU.
    unplanned.start(pool="local", gpus=1)
    unplanned.report(unplanned.metric(1, 10, 2.0, tokens_per_s=900.0))
    done.start(pool="local", gpus=1, throughput=basis)
    done.report(done.metric(1, 10, 2.0, tokens_per_s=100_000.0))
    done.finish("succeeded")  # no longer running: not counted

    open_scrape = scrape(service.base_url)
    monkeypatch.setenv("TUNEFLEET_METRICS_TOKEN", "scrape-secret")
    m = scrape(service.base_url, authorization="Bearer scrape-secret")
    for families in (open_scrape, m):
        assert value(families, "tunefleet_pool_tokens_per_second", pool="mi300x") == pytest.approx(125_000.0)
        assert value(families, "tunefleet_pool_mfu", pool="mi300x") == pytest.approx((0.45 + 0.30) / 2)
        assert value(families, "tunefleet_pool_tokens_per_second", pool="local") == 900.0
        assert not any(s.labels.get("pool") == "local" for s in families.get("tunefleet_pool_mfu", []))
    assert value(m, "tunefleet_job_mfu", job_id=fast.job_id, pool="mi300x") == pytest.approx(0.45)
    assert not any(s.labels["job_id"] == unplanned.job_id for s in m["tunefleet_job_mfu"])


def test_metrics_token_when_configured(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEFLEET_METRICS_TOKEN", "scrape-secret")
    denied = httpx.get(f"{service.base_url}/metrics", timeout=10)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_metrics_token"
    assert "tunefleet_jobs" in scrape(service.base_url, authorization="Bearer scrape-secret")


def test_open_metrics_name_no_job(service: Service) -> None:
    """Without a token (a developer's machine) anyone who reaches /metrics reads it: the
    counts are there, the ids of other tenants' running jobs are not."""
    with Tunefleet(base_url=service.base_url, api_key=service.key) as client:
        fid = client.files.upload(chat_jsonl(), filename="t.jsonl", wait=True).id
        running = client.jobs.create(model=DEMO_MODEL, training_file=fid)
    driver = JobDriver(service, running.id)
    driver.start(pool="local", gpus=1)
    driver.report(driver.metric(1, 10, 2.5, tokens_per_s=900.0))
    text = httpx.get(f"{service.base_url}/metrics", timeout=10).text
    m = scrape(service.base_url)
    assert value(m, "tunefleet_jobs", status="running", pool="local") == 1
    assert running.id not in text
    assert not any("job_id" in s.labels for samples in m.values() for s in samples)


def test_multiprocess_mode_aggregates_every_process(tmp_path: Path) -> None:
    """Two writer processes and one scraper share PROMETHEUS_MULTIPROC_DIR."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    writer = textwrap.dedent("""
        from api.observability.metrics import REQUEST_LATENCY
        from control.observability.registry import WEBHOOK_FAILURES
        REQUEST_LATENCY.labels("GET", "/v1/files", "200").observe(0.02)
        WEBHOOK_FAILURES.inc()
    """)
    for _ in range(2):
        subprocess.run([sys.executable, "-c", writer], env=env, check=True, cwd=REPO)
    scraper = textwrap.dedent("""
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        print(generate_latest(registry).decode())
    """)
    out = subprocess.run([sys.executable, "-c", scraper], env=env, check=True, cwd=REPO,
                         capture_output=True, text=True).stdout
    families = {f.name: f.samples for f in text_string_to_metric_families(out)}
    assert value(families, "tunefleet_webhook_delivery_failures_total") == 2
    assert value(families, "tunefleet_http_request_duration_seconds_count", route="/v1/files") == 2


def test_grafana_dashboard_queries_only_exposed_metrics(service: Service, capacity: None,
                                                       scrape_token: dict[str, str]) -> None:
    import json
    import re

    from prometheus_client import CollectorRegistry, generate_latest

    from tests.deploy.test_chart_monitoring import rule_expressions
    from worker.metrics import LAST_CYCLE, scheduler_cycled

    dashboard = json.loads((REPO / "deploy/grafana/tunefleet-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    # Every series is aggregated across the scraped pods: none is drawn once per replica.
    for expr in exprs:
        for side in expr.split(" / "):
            assert re.match(r"\s*(sum|max|histogram_quantile)\b", side), expr
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"pool", "job"} <= variables
    assert all("$pool" in e for e in exprs if "pool" in e and "tunefleet_http" not in e)
    used = {m for e in exprs + rule_expressions() for m in re.findall(r"\btunefleet_[a-z_]+", e)}
    with Tunefleet(base_url=service.base_url, api_key=service.key) as client:
        client.jobs.list()
        fid = client.files.upload(chat_jsonl(), filename="t.jsonl", wait=True).id
        driver = JobDriver(service, client.jobs.create(model=DEMO_MODEL, training_file=fid).id)
    driver.start()
    driver.report(driver.metric(1, 2, 1.0))
    m = scrape(service.base_url, **scrape_token)
    exposed = {s.name for samples in m.values() for s in samples}
    # The scheduler's own gauge, from its collector.
    scheduler_cycled()
    registry = CollectorRegistry()
    registry.register(LAST_CYCLE)
    exposed |= {s.name for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert used and used <= exposed, used - exposed
    # Nothing queued: the queue gauges still report 0 for every known pool.
    assert value(m, "tunefleet_queue_depth", pool="mi300x") == 0


# ---- every component of a deployment, scraped as Prometheus does ----------------------------


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from tunefleet.cli.main import app; app()", *args]


def _uvicorn(port: int, workers: int = 1) -> list[str]:
    return [sys.executable, "-m", "uvicorn", "--factory", "api.main:create_app", "--host", "127.0.0.1",
            f"--port={port}", f"--workers={workers}", "--log-level=warning"]


def _wait_ok(url: str, procs: list[subprocess.Popen[bytes]], timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a component exited during start-up"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} never answered 200")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _summed(targets: list[dict[str, list[Any]]], name: str, by: str) -> dict[str, float]:
    """``sum by (<by>) (<name>)`` over every scraped target."""
    total: dict[str, float] = {}
    for families in targets:
        for sample in (s for samples in families.values() for s in samples if s.name == name):
            total[sample.labels[by]] = total.get(sample.labels[by], 0.0) + sample.value
    return total


def test_database_gauges_are_exported_once_across_api_replicas(service: Service, tmp_path: Path) -> None:
    """Two API processes and two scheduler replicas (one active, one standby that finds
    the scheduler lease taken) on one database, set up as the chart sets them up
    (``TUNEFLEET_METRICS_DATABASE_GAUGES=scheduler``): ``sum by (status)`` over all four
    targets equals the database's counts."""
    from sqlalchemy import func, select

    from control.db.models import Job
    from control.db.session import session_scope
    from tests.conftest import free_port, settings_env

    env = {**settings_env(service.settings), "TUNEFLEET_METRICS_DATABASE_GAUGES": "scheduler",
           # One cycle at start-up, then none during the test: the counts stay put.
           "TUNEFLEET_SCHEDULE_INTERVAL_S": "3600"}
    api_ports = [free_port(), free_port()]
    scheduler_port, standby_port = free_port(), free_port()
    procs = [_start(_uvicorn(port), env, tmp_path / f"api-{port}.log") for port in api_ports]
    procs.append(_start(_cli("scheduler"), {**env, "TUNEFLEET_METRICS_PORT": str(scheduler_port)},
                        tmp_path / "scheduler.log"))
    try:
        for port in api_ports:
            _wait_ok(f"http://127.0.0.1:{port}/healthz", procs)
        _wait_ok(f"http://127.0.0.1:{scheduler_port}/healthz", procs)  # its first cycle ran, with the lease
        # The active replica keeps the lease (its cycles renew it): the standby's cycle
        # finds it held and skips.
        procs.append(_start(_cli("scheduler"), {**env, "TUNEFLEET_METRICS_PORT": str(standby_port)},
                            tmp_path / "standby.log"))
        _wait_ok(f"http://127.0.0.1:{standby_port}/healthz", procs)
        with Tunefleet(base_url=service.base_url, api_key=service.key) as client:
            fid = client.files.upload(chat_jsonl(), filename="t.jsonl", wait=True).id
            ids = [client.jobs.create(model=DEMO_MODEL, training_file=fid).id for _ in range(4)]
        JobDriver(service, ids[0]).start(pool="local", gpus=1)
        finished = JobDriver(service, ids[1])
        finished.start(pool="local", gpus=1)
        finished.finish("succeeded")

        targets = [scrape(f"http://127.0.0.1:{port}") for port in api_ports]
        targets.append(scrape(f"http://127.0.0.1:{scheduler_port}"))
        targets.append(scrape(f"http://127.0.0.1:{standby_port}"))
        with session_scope(service.settings.resolved_database_url) as session:
            in_db = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).tuples().all())
    finally:
        _stop(procs)
    assert in_db == {"queued": 2, "running": 1, "succeeded": 1}
    assert _summed(targets, "tunefleet_jobs", "status") == in_db
    assert _summed(targets, "tunefleet_queue_depth", "pool") == {"any": 2, "local": 0}
    assert _summed(targets, "tunefleet_gpus_allocated", "pool") == {"local": 1}
    up = [s.value for t in targets for s in t.get("tunefleet_metrics_database_up", [])]
    assert up == [1]  # one target collected them, and from the database
    # The API replicas still export their own request latency; the scheduler its last cycle.
    assert all("tunefleet_http_request_duration_seconds" in t for t in targets[:2])
    assert value(targets[2], "tunefleet_scheduler_last_cycle_timestamp_seconds") > 0
    assert "tunefleet_jobs" not in targets[3]
    assert value(targets[3], "tunefleet_scheduler_last_cycle_timestamp_seconds") > 0


def test_a_webhook_failure_in_the_worker_shows_in_the_workers_metrics(
        service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tunefleet worker`` serves /metrics: the failed delivery it attempted is counted there."""
    from control.queue import DELIVER_WEBHOOK, CeleryQueue
    from control.settings import get_settings
    from control.webhooks import events
    from tests.conftest import free_port, settings_env
    from tests.integrations.webhook_receiver import Receiver

    monkeypatch.setenv("TUNEFLEET_WEBHOOK_ALLOW_PRIVATE", "true")
    get_settings.cache_clear()
    receiver = Receiver().start()
    receiver.answer = lambda received: 500
    port = free_port()
    env = {**settings_env(service.settings), "TUNEFLEET_METRICS_PORT": str(port),
           "TUNEFLEET_WEBHOOK_ALLOW_PRIVATE": "true", "TUNEFLEET_WEBHOOK_RETRY_BASE_S": "3600"}
    worker = _start(_cli("worker", "--concurrency=2", "--loglevel=INFO"), env, tmp_path / "worker.log")
    try:
        _wait_ok(f"http://127.0.0.1:{port}/healthz", [worker])  # the consumer has beaten
        before = scrape(f"http://127.0.0.1:{port}")
        assert value(before, "tunefleet_webhook_delivery_failures_total") == 0
        queue = CeleryQueue(service.settings)
        events.set_dispatcher(lambda delivery_id: queue.send(DELIVER_WEBHOOK, delivery_id))
        with Tunefleet(base_url=service.base_url, api_key=service.key) as client:
            client.webhooks.create(url=receiver.url)
            fid = client.files.upload(chat_jsonl(), filename="t.jsonl", wait=True).id
            job_id = client.jobs.create(model=DEMO_MODEL, training_file=fid).id
        JobDriver(service, job_id).start()  # fine_tuning.job.running -> the receiver says 500
        receiver.wait_for(lambda received: len(received) >= 1, timeout=60)
        import time

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            after = scrape(f"http://127.0.0.1:{port}")
            if value(after, "tunefleet_webhook_delivery_failures_total") >= 1:
                break
            time.sleep(0.3)
    finally:
        events.set_dispatcher(None)
        get_settings.cache_clear()
        _stop([worker])
        receiver.stop()
    # Exactly the one attempt made (retries are an hour away).
    assert value(after, "tunefleet_webhook_delivery_failures_total") == 1
    assert len(receiver.received) == 1


def test_two_uvicorn_workers_report_one_histogram(service: Service, tmp_path: Path) -> None:
    """uvicorn --workers=2 with PROMETHEUS_MULTIPROC_DIR (as the chart runs the API): every
    scrape, whichever process answers it, counts the requests of both processes."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.conftest import free_port, settings_env

    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    port = free_port()
    env = {**settings_env(service.settings), "PROMETHEUS_MULTIPROC_DIR": str(multiproc)}
    api = _start(_uvicorn(port, workers=2), env, tmp_path / "api.log")
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ok(f"{base}/healthz", [api])
        with httpx.Client(timeout=10) as http:
            http.get(f"{base}/healthz")  # warm-up requests are counted too: reset the tally below
            with ThreadPoolExecutor(8) as pool:
                codes = list(pool.map(lambda _: httpx.get(f"{base}/healthz", timeout=10).status_code, range(200)))
            assert codes == [200] * 200
            scrapes = [scrape(base) for _ in range(6)]
    finally:
        _stop([api])
    expected = {s.labels["route"]: s.value for s in scrapes[0]["tunefleet_http_request_duration_seconds"]
                if s.name.endswith("_count") and s.labels["route"] == "/healthz"}
    assert expected["/healthz"] >= 202  # 200 + the warm-up + the readiness polls
    for families in scrapes:
        count = value(families, "tunefleet_http_request_duration_seconds_count", route="/healthz")
        assert count == expected["/healthz"]
    # Both processes served requests (each writes its own file), yet every scrape agrees.
    writers = {p.name for p in multiproc.glob("histogram_*.db")}
    assert len(writers) == 2, writers
