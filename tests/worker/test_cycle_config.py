"""The cycle's policy comes from the one settings class (``TUNEFLEET_*``), not code defaults."""

import pytest

from control.settings import Settings
from scheduling.placement import PreemptionPolicy
from tests.worker.builders import cluster, make_job, rtx4090, running
from worker.scheduler.cycle import CycleConfig, plan_cycle
from worker.scheduler.loop import build_components, cycle_config


def _full_pool_and_a_high_job():
    snap = cluster(rtx4090(1), running=[running("low", "rtx4090", [("rtx4090-0", 2)], priority="low")])
    return snap, make_job().qlora("7b").id("high").priority("high").gpus(2).build()


@pytest.mark.parametrize(("env", "preempts"), [
    ({}, True),
    ({"TUNEFLEET_PREEMPTION_ENABLED": "false"}, False),
    ({"TUNEFLEET_PREEMPTION_MIN_PRIORITY_GAP": "1000"}, False),  # high - low is smaller than that
])
def test_preemption_policy_from_the_environment(monkeypatch, env, preempts):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = cycle_config(Settings())
    snap, job = _full_pool_and_a_high_job()
    plan = plan_cycle([job], snap, now=0.0, config=config)
    assert [p.victim_id for p in plan.preemptions] == (["low"] if preempts else [])
    assert not plan.admissions and [w.job.job_id for w in plan.waiting] == ["high"]


def test_objective_from_the_environment(monkeypatch):
    assert cycle_config(Settings()) == CycleConfig()  # the defaults are the cycle's own
    monkeypatch.setenv("TUNEFLEET_PLACEMENT_OBJECTIVE", "time")
    assert cycle_config(Settings()).objective == "time"
    monkeypatch.setenv("TUNEFLEET_PLACEMENT_OBJECTIVE", "fastest")
    with pytest.raises(ValueError, match="placement_objective"):
        Settings()


def test_the_scheduler_builds_its_cycle_from_the_settings(settings):
    tuned = settings.model_copy(update={"preemption_enabled": False, "placement_objective": "time"})
    config = build_components(tuned).config
    assert config.preemption == PreemptionPolicy(enabled=False) and config.objective == "time"
