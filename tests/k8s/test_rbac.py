"""Every request the executor makes is allowed by the Helm chart's Role/ClusterRole.

The fake API server records (verb, resource) for each request it serves; a scenario
covering every executor path (launch single- and multi-node, reconcile through the
informers, snapshot, logs, stop, a 410 relist) must stay within the chart's rules.
"""

import re
from pathlib import Path

import yaml

from tests.k8s.test_kubernetes_executor import Row, executor, kinds, placement, spec, until
from worker.executors.base import ObservedKind, StopReason

CHART_RBAC = Path(__file__).resolve().parents[2] / "helm/tunefleet/templates/rbac.yaml"


def chart_rules() -> set[tuple[str, str]]:
    text = re.sub(r"\{\{-?\s*/\*.*?\*/\s*-?\}\}", "", CHART_RBAC.read_text(), flags=re.DOTALL)  # comments
    text = re.sub(r"^\s*\{\{-?.*?-?\}\}\s*$", "", text, flags=re.MULTILINE)
    text = re.sub(r"\{\{.*?\}\}", "x", text)
    allowed = set()
    for doc in yaml.safe_load_all(text):
        if doc and doc.get("kind") in ("Role", "ClusterRole"):
            for rule in doc["rules"]:
                allowed |= {(v, r) for v in rule["verbs"] for r in rule["resources"]}
    return allowed


def test_executor_uses_only_verbs_the_chart_grants(fake_api):
    ex = executor(fake_api, mode="sleep", start=False)
    ex.sync()
    ex.launch(Row("ftjob-R1"), spec("ftjob-R1"), placement())
    ex.launch(Row("ftjob-R2"), spec("ftjob-R2"), placement("mi300x", nodes=2, gpn=8, trainer="jax_lora"))
    until(fake_api, ex, lambda s: kinds(s).count(ObservedKind.STARTED) >= 2)
    ex.snapshot()
    fake_api.wait_for(lambda: "ftjob-R1" in ex.logs("ftjob-R1"))
    fake_api.cluster.expire_history()
    ex.stop(Row("ftjob-R1"), StopReason.CANCEL)
    ex.stop(Row("ftjob-R2"), StopReason.PREEMPT)
    until(fake_api, ex, lambda s: kinds(s).count(ObservedKind.STOPPED) >= 2)
    used = set(fake_api.cluster.requests)
    assert ex.pods.relists >= 2
    allowed = chart_rules()
    assert used <= allowed, f"not granted by the chart: {sorted(used - allowed)}"
    assert {("create", "jobs"), ("watch", "pods"), ("get", "pods/log"), ("list", "nodes"),
            ("create", "services"), ("delete", "jobs")} <= used
