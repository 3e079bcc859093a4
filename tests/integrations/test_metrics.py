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
def capacity() -> Iterator[None]:
    from api.observability.collectors import set_pool_capacity_provider

    set_pool_capacity_provider(lambda: {"local": 4, "mi300x": 8})
    yield
    set_pool_capacity_provider(None)


def test_metrics_reflect_jobs_queue_gpus_trainers_and_requests(service: Service, capacity: None) -> None:
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

    m = scrape(service.base_url)
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


def test_metrics_token_when_configured(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEFLEET_METRICS_TOKEN", "scrape-secret")
    denied = httpx.get(f"{service.base_url}/metrics", timeout=10)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_metrics_token"
    assert "tunefleet_jobs" in scrape(service.base_url, authorization="Bearer scrape-secret")


def test_multiprocess_mode_aggregates_every_process(tmp_path: Path) -> None:
    """Two writer processes and one scraper share PROMETHEUS_MULTIPROC_DIR."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    writer = textwrap.dedent("""
        from api.observability.metrics import REQUEST_LATENCY, WEBHOOK_FAILURES
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


def test_grafana_dashboard_queries_only_exposed_metrics(service: Service, capacity: None) -> None:
    import json
    import re

    dashboard = json.loads((REPO / "deploy/grafana/tunefleet-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\btunefleet_[a-z_]+", e)}
    with Tunefleet(base_url=service.base_url, api_key=service.key) as client:
        client.jobs.list()
        fid = client.files.upload(chat_jsonl(), filename="t.jsonl", wait=True).id
        driver = JobDriver(service, client.jobs.create(model=DEMO_MODEL, training_file=fid).id)
    driver.start()
    driver.report(driver.metric(1, 2, 1.0))
    m = scrape(service.base_url)
    exposed = {s.name for samples in m.values() for s in samples}
    assert used and used <= exposed, used - exposed
    # Nothing queued: the queue gauges still report 0 for every known pool.
    assert value(m, "tunefleet_queue_depth", pool="mi300x") == 0
