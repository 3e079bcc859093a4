"""``tunefleet.schedule`` (the worker's cycle on demand) runs cycles in local mode only.

In Kubernetes mode the scheduler process alone launches and reconciles: a cycle in the
worker would build a second KubernetesExecutor, whose launches no other process observes.
"""

import pytest

import worker.tasks.scheduling as task
from worker.scheduler.cycle import CycleResult


@pytest.fixture
def built(monkeypatch):
    calls = []

    def build(settings):
        calls.append(settings.executor)
        return object()

    monkeypatch.setattr(task, "_components", None)
    monkeypatch.setattr(task, "build_components", build)
    monkeypatch.setattr(task, "run_once", lambda components: CycleResult(ran=False))
    return calls


def test_kubernetes_mode_builds_no_executor_in_the_worker(settings, monkeypatch, built):
    monkeypatch.setattr(task, "get_settings", lambda: settings.model_copy(update={"executor": "kubernetes"}))
    assert task.schedule() == {"ran": 0, "admitted": 0, "preempted": 0, "waiting": 0}
    assert built == []


def test_local_mode_runs_a_cycle(settings, monkeypatch, built):
    monkeypatch.setattr(task, "get_settings", lambda: settings)
    task.schedule()
    assert built == ["local"]
