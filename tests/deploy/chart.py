"""Render the Helm chart offline (helm-python-sdk: Helm's Go SDK through ctypes).

Nothing here talks to a cluster: `Chart.render` is `helm template`, and `lookup` returns
nothing, exactly as on a first install.
"""

from __future__ import annotations

import base64
import os
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "tunefleet"
VALUES_DIR = Path(__file__).resolve().parent / "values"
RELEASE = "tf"
NAMESPACE = "tunefleet"
KUBE_VERSIONS = ("1.30", "1.33")

# name -> values ("default" = the chart's own values.yaml and nothing else).
VALUES_FILES = {"default": None} | {p.stem: p for p in sorted(VALUES_DIR.glob("*.yaml"))}


def load_values(name: str) -> dict[str, Any]:
    path = VALUES_FILES[name]
    return {} if path is None else yaml.safe_load(path.read_text(encoding="utf-8"))


def render(values: dict[str, Any]) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would print it."""
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


@cache
def rendered_docs(name: str) -> tuple[dict[str, Any], ...]:
    """Every Kubernetes object the chart renders for the named values set."""
    docs: list[dict[str, Any]] = []
    for path, text in sorted(render(load_values(name)).items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return tuple(docs)


def find(
    docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None
) -> list[dict[str, Any]]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_specs(docs: tuple[dict[str, Any], ...]) -> list[tuple[str, dict[str, Any]]]:
    """(object name, pod spec) of every Deployment and Job."""
    return [
        (d["metadata"]["name"], d["spec"]["template"]["spec"])
        for d in docs
        if d["kind"] in ("Deployment", "Job")
    ]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def resolved_env(docs: tuple[dict[str, Any], ...], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment with references to rendered Secrets resolved."""
    secrets = {
        s["metadata"]["name"]: {
            k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()
        }
        for s in find(docs, "Secret")
    }
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            value = secrets.get(ref["name"], {}).get(ref["key"])
            if value is not None:
                env[item["name"]] = value
    return env


def settings_from(env: dict[str, str], monkeypatch: Any) -> Any:
    """``control.settings.Settings`` read from exactly ``env`` (no other TUNEFLEET_* variable)."""
    from control.settings import Settings

    for name in list(os.environ):
        if name.startswith("TUNEFLEET_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Settings()
