"""The chart's metrics wiring: who exports what, probes, the PodMonitor and the alert rules.

The PodMonitor and PrometheusRule are prometheus-operator CRDs with no schema here, so
their fields are checked against what the operator's v1 API defines; that every metric
the rules name is really exported is checked by tests/integrations/test_metrics.py.
"""

from __future__ import annotations

import pytest
import yaml

from tests.deploy.chart import (
    VALUES_FILES,
    find,
    one,
    render,
    rendered_docs,
    resolved_env,
    settings_from,
)

FULL = "tf-tunefleet"
PRODUCTION = {"database": {"url": "postgresql://tf:pw@db.svc:5432/tf"}, "broker": {"url": "redis://redis.svc:6379/0"}}
MONITORING = {**PRODUCTION, "metrics": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}},
                                        "prometheusRule": {"enabled": True}}}


def docs_for(values: dict) -> tuple[dict, ...]:
    return tuple(d for path, text in sorted(render(values).items()) if path.endswith(".yaml")
                 for d in yaml.safe_load_all(text) if d)


def container(docs: tuple[dict, ...], component: str) -> dict:
    return one(docs, "Deployment", f"{FULL}-{component}")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_monitoring_objects_are_off_by_default(name: str) -> None:
    kinds = {d["kind"] for d in rendered_docs(name)}
    assert not kinds & {"PodMonitor", "ServiceMonitor", "PrometheusRule"}


def test_the_database_gauges_come_from_the_scheduler_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = docs_for(PRODUCTION)
    api = settings_from(resolved_env(docs, container(docs, "api")), monkeypatch)
    scheduler = settings_from(resolved_env(docs, container(docs, "scheduler")), monkeypatch)
    worker = settings_from(resolved_env(docs, container(docs, "worker")), monkeypatch)
    assert api.metrics_database_gauges == "scheduler" and scheduler.metrics_database_gauges == "scheduler"
    assert scheduler.metrics_port == worker.metrics_port == 9090
    assert one(docs, "Deployment", f"{FULL}-scheduler")["spec"]["replicas"] == 1


def test_the_api_workers_share_a_multiprocess_directory_emptied_per_pod() -> None:
    docs = docs_for(PRODUCTION)
    api = container(docs, "api")
    assert "--workers=2" in api["command"]
    path = resolved_env(docs, api)["PROMETHEUS_MULTIPROC_DIR"]
    (mount,) = [m for m in api["volumeMounts"] if m["mountPath"] == path]
    spec = one(docs, "Deployment", f"{FULL}-api")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume


@pytest.mark.parametrize("component", ["worker", "scheduler"])
def test_worker_and_scheduler_serve_metrics_and_are_probed(component: str) -> None:
    docs = docs_for(PRODUCTION)
    c = container(docs, component)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": int(resolved_env(docs, c)["TUNEFLEET_METRICS_PORT"])}
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # The NetworkPolicy that closes these pods lets the metrics port (and nothing else) in.
    policy = one(docs, "NetworkPolicy", f"{FULL}-control-plane")
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "metrics", "protocol": "TCP"}]}]


def test_pod_monitor_scrapes_every_component_with_the_metrics_token() -> None:
    docs = docs_for(MONITORING)
    (monitor,) = find(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    (components,) = [e for e in monitor["spec"]["selector"]["matchExpressions"]
                     if e["key"] == "app.kubernetes.io/component"]
    assert set(components["values"]) == {"api", "worker", "scheduler"}
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert {e["port"] for e in endpoints} == {"http", "metrics"}
    secrets = {s["metadata"]["name"]: s for s in find(docs, "Secret")}
    for endpoint in endpoints:
        assert endpoint["path"] == "/metrics"
        credentials = endpoint["authorization"]["credentials"]
        assert endpoint["authorization"]["type"] == "Bearer"
        assert credentials["key"] in secrets[credentials["name"]]["data"]
    # Each component's pod has the port an endpoint names.
    for component in ("api", "worker", "scheduler"):
        names = {p["name"] for p in container(docs, component)["ports"]}
        assert names & {e["port"] for e in endpoints}, component


def test_prometheus_rule_has_the_alerts_and_takes_thresholds_from_values() -> None:
    values = {**MONITORING, "metrics": {**MONITORING["metrics"], "prometheusRule": {
        "enabled": True, "queueStuckSeconds": 600, "jobFailureRatio": 0.5, "webhookFailuresPerSecond": 0.2}}}
    (rule,) = find(docs_for(values), "PrometheusRule")
    rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(rules) == {"TunefleetQueueStuck", "TunefleetSchedulerStalled", "TunefleetJobFailureRate",
                          "TunefleetWebhookFailures", "TunefleetWebhookDeliveriesGivenUp"}
    assert rules["TunefleetQueueStuck"]["expr"].endswith("> 600")
    assert rules["TunefleetJobFailureRate"]["expr"].rstrip().endswith("> 0.5")
    assert rules["TunefleetWebhookFailures"]["expr"].endswith("> 0.2")
    for r in rules.values():
        assert r["labels"]["severity"] in {"warning", "critical"} and r["annotations"]["summary"]
    # Prometheus' own template syntax survives Helm's.
    assert "{{ $labels.pool }}" in rules["TunefleetQueueStuck"]["annotations"]["summary"]


def rule_expressions() -> list[str]:
    """Every alert expression of the rendered PrometheusRule (for the exposure test)."""
    (rule,) = find(docs_for(MONITORING), "PrometheusRule")
    return [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]


def _selectors(expr) -> list:
    """Every vector selector of a parsed PromQL expression (promql_parser's AST)."""
    import promql_parser

    if isinstance(expr, promql_parser.VectorSelector):
        return [expr]
    found = []
    for field in ("expr", "lhs", "rhs", "param", "vector_selector"):
        child = getattr(expr, field, None)
        if child is not None and not isinstance(child, str | int | float):
            found += _selectors(child)
    for arg in getattr(expr, "args", None) or []:
        found += _selectors(arg)
    return found


def test_every_alert_and_dashboard_query_is_valid_promql() -> None:
    """Prometheus would refuse a rule it cannot parse (the whole PrometheusRule group) and
    Grafana shows an error panel: both sets of expressions go through a PromQL parser (the
    dashboard's ``$pool``/``$job`` variables stand inside label matchers, as Grafana
    substitutes them). Each names tunefleet metrics only."""
    import json

    import promql_parser

    from tests.conftest import REPO

    dashboard = json.loads((REPO / "deploy/grafana/tunefleet-dashboard.json").read_text())
    exprs = rule_expressions() + [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) > 5
    for expr in exprs:
        try:
            parsed = promql_parser.parse(expr.replace("$pool", "gpu-pool").replace("$job", "ftjob-x"))
        except ValueError as exc:
            raise AssertionError(f"{expr!r}: {exc}") from None
        names = {s.name for s in _selectors(parsed)}
        assert names and all(n.startswith("tunefleet_") for n in names), (expr, names)


def test_allowed_private_hosts_reach_the_components_that_check_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """``webhooks.allowedHosts`` reaches the API (saving an endpoint) and the worker
    (delivering); ``trackers.allowedHosts`` the API and the scheduler, which passes it on
    to trainer pods. Production accepts both (unlike allowing every private address)."""
    hosts = {"webhooks": {"allowedHosts": ["hooks.platform.svc:8080", "10.0.0.7"]},
             "trackers": {"allowedHosts": ["mlflow.ml.svc:5000"]}}
    docs = docs_for({**PRODUCTION, **hosts})
    for component in ("api", "worker", "scheduler"):
        settings = settings_from(resolved_env(docs, container(docs, component)), monkeypatch)
        assert settings.env == "production"
        assert settings.webhook_allowed_hosts == "hooks.platform.svc:8080,10.0.0.7"
        assert settings.tracker_allowed_hosts == "mlflow.ml.svc:5000"
    plain = docs_for(PRODUCTION)
    assert settings_from(resolved_env(plain, container(plain, "api")), monkeypatch).webhook_allowed_hosts is None
