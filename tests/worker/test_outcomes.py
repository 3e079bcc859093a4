"""Run attempts on the real database: an old run's exit never moves a newer run, and the
scheduler starts a job's next attempt only once the previous trainer has stopped; a run's
end fills what its reports never delivered from its trainer's outputs, and a job never
succeeds with holes in its records unannounced.

Jobs are created through the API and admitted by ``DbStore`` (the scheduler's store);
outcomes go through ``DbStore.apply_observed`` -> ``worker.outcomes.apply_outcome``, the
path both executors share.
"""

import json
from pathlib import Path

from control.db.models import Checkpoint, Job, JobMetric
from control.db.session import session_scope
from control.ids import new_id
from scheduling.pools import local_pool
from tests.api.conftest import make_job, processed_file, upload  # noqa: F401 (fixtures)
from tests.worker.test_db_store import Clock, RecordingExecutor, _tiny_config
from worker.executors.base import ObservedChange, ObservedKind, StopReason
from worker.scheduler.cycle import run_cycle
from worker.scheduler.store import STOP_MARGIN_S, DbStore

JOBS = "/v1/fine_tuning/jobs"


def _row(settings, job_id: str) -> Job:
    with session_scope(settings.resolved_database_url) as session:
        job = session.get_one(Job, job_id)
        session.expunge(job)
        return job


def _scheduler(settings):
    pools = [local_pool(slots=1)]
    clock = Clock()
    return DbStore(settings, pools, clock=clock), RecordingExecutor(pools), clock


def test_pause_and_resume_wait_for_the_old_run_and_ignore_its_exit(settings, client, tenant_key, make_job):  # noqa: F811
    _tiny_config(settings)
    tenant = tenant_key()
    job_id = make_job(tenant.headers)["id"]
    store, ex, clock = _scheduler(settings)
    run_cycle(store, ex, clock=clock)
    assert _row(settings, job_id).attempt == 1

    # Paused and resumed before the trainer stopped: the next attempt waits for it.
    clock.t += 100
    assert client.post(f"{JOBS}/{job_id}/pause", headers=tenant.headers).json()["status"] == "paused"
    assert client.post(f"{JOBS}/{job_id}/resume", headers=tenant.headers).json()["status"] == "queued"
    ex.running.clear()
    run_cycle(store, ex, clock=clock)
    waiting = client.get(f"{JOBS}/{job_id}", headers=tenant.headers).json()
    assert waiting["status"] == "queued" and len(ex.launches) == 1
    assert waiting["queue_reason"] == "waiting: its previous run is still stopping (writing its checkpoint)"
    # The pause ended the usage segment: nothing stays open while the job waits.
    assert waiting["usage"]["segments"][0]["end"] is not None and waiting["usage"]["gpu_seconds"] > 0

    # The old run's exit (attempt 1) is recorded; the job is admitted as attempt 2.
    store.apply_observed([ObservedChange(job_id, ObservedKind.STOPPED, stop_reason=StopReason.PAUSE,
                                         message="trainer checkpointed and stopped (pause)", attempt=1)])
    assert _row(settings, job_id).exited_attempt == 1
    run_cycle(store, ex, clock=clock)
    row = _row(settings, job_id)
    assert (row.status, row.attempt, len(ex.launches)) == ("running", 2, 2)

    # A late outcome of attempt 1 (a duplicate observation) must not end attempt 2.
    store.apply_observed([ObservedChange(job_id, ObservedKind.SUCCEEDED, message="trainer finished", attempt=1)])
    row = _row(settings, job_id)
    assert (row.status, row.attempt) == ("running", 2)
    events = [e["message"] for e in client.get(f"{JOBS}/{job_id}/events", headers=tenant.headers).json()["data"]]
    assert any(m.startswith("The run of attempt 1 stopped") for m in events), events

    # The current attempt's outcome does end it, with its usage closed.
    clock.t += 50
    store.apply_observed([ObservedChange(job_id, ObservedKind.SUCCEEDED, message="trainer finished", attempt=2)])
    done = client.get(f"{JOBS}/{job_id}", headers=tenant.headers).json()
    assert done["status"] == "succeeded"
    assert [s["end"] is not None for s in done["usage"]["segments"]] == [True, True]


def test_a_run_whose_outcome_never_comes_is_waited_for_only_until_the_stop_deadline(
        settings, client, tenant_key, make_job):  # noqa: F811
    _tiny_config(settings)
    tenant = tenant_key()
    job_id = make_job(tenant.headers)["id"]
    store, ex, clock = _scheduler(settings)
    run_cycle(store, ex, clock=clock)
    client.post(f"{JOBS}/{job_id}/pause", headers=tenant.headers)
    client.post(f"{JOBS}/{job_id}/resume", headers=tenant.headers)
    ex.running.clear()
    left = _row(settings, job_id).usage["segments"][-1]["end"]

    clock.t = left + settings.stop_grace_s + STOP_MARGIN_S - 1
    run_cycle(store, ex, clock=clock)
    assert len(ex.launches) == 1
    clock.t = left + settings.stop_grace_s + STOP_MARGIN_S + 1
    run_cycle(store, ex, clock=clock)
    assert len(ex.launches) == 2 and _row(settings, job_id).attempt == 2


def test_a_lost_run_restarts_after_a_backoff_that_doubles_with_each_restart(
        settings, client, tenant_key, make_job):  # noqa: F811
    """Without a pause between restarts a fault that outlives one attempt (an object store
    down for a minute) used up max_restarts in seconds; each restart now waits base, then
    2x base (``restart_delay_s``), measured from the requeue."""
    _tiny_config(settings)
    tenant = tenant_key()
    job_id = make_job(tenant.headers)["id"]
    store, ex, clock = _scheduler(settings.model_copy(update={"restart_backoff_s": 10.0,
                                                              "restart_backoff_max_s": 15.0}))
    run_cycle(store, ex, clock=clock)

    for attempt, delay in ((1, 10.0), (2, 15.0)):  # 20 s capped at 15 s
        ex.running.clear()
        store.apply_observed([ObservedChange(job_id, ObservedKind.REQUEUE, message="the trainer crashed",
                                             error_code="trainer_crashed", attempt=attempt)])
        requeued_at = clock.t
        row = _row(settings, job_id)
        assert (row.status, row.restarts, row.restart_not_before.timestamp()) == (
            "queued", attempt, requeued_at + delay)
        clock.t = requeued_at + delay - 1
        run_cycle(store, ex, clock=clock)
        waiting = client.get(f"{JOBS}/{job_id}", headers=tenant.headers).json()
        assert waiting["status"] == "queued" and len(ex.launches) == attempt, waiting
        assert waiting["queue_reason"].startswith(f"waiting: restart {attempt} starts at "), waiting["queue_reason"]
        clock.t = requeued_at + delay + 1
        run_cycle(store, ex, clock=clock)
        assert (_row(settings, job_id).status, len(ex.launches)) == ("running", attempt + 1)
    events = [e["message"] for e in client.get(f"{JOBS}/{job_id}/events", headers=tenant.headers).json()["data"]]
    assert any("(restart 2 of 2); resumes from the start in 15 s." in m for m in events), events


def test_restart_delays_double_from_the_base_up_to_the_cap() -> None:
    from worker.executors.base import restart_delay_s

    assert [restart_delay_s(n, base_s=10, max_s=300) for n in range(8)] == [0, 10, 20, 40, 80, 160, 300, 300]
    assert restart_delay_s(3, base_s=0, max_s=300) == 0  # backoff off
    assert restart_delay_s(10_000, base_s=1, max_s=5) == 5  # no float overflow on a long-lived job


def _reported(settings, job_id: str, steps: list[int], checkpoints: list[int], total: int) -> None:
    """What the trainer's reports delivered: these metric steps and checkpoint listings."""
    with session_scope(settings.resolved_database_url) as session:
        for step in steps:
            session.add(JobMetric(job_id=job_id, step=step, total_steps=total, train_loss=1.0 / step))
        for step in checkpoints:
            session.add(Checkpoint(id=new_id("ftckpt"), job_id=job_id, step=step, metrics={},
                                   location=str(_checkpoint_dir(settings, job_id, step))))
        session.get_one(Job, job_id).total_steps = total
        session.commit()


def _checkpoint_dir(settings, job_id: str, step: int) -> Path:
    return settings.job_dir(job_id) / "checkpoints" / f"step-{step}"


def _trainer_wrote(settings, job_id: str, steps: list[int], checkpoints: list[int], total: int) -> None:
    """What the trainer left on disk: its output's metrics.jsonl and checkpoint folders."""
    output = Path(settings.resolved_artifact_url) / job_id / "output"
    output.mkdir(parents=True, exist_ok=True)
    rows = [json.dumps({"step": s, "total_steps": total, "train_loss": 1.0 / s, "time": 1.0}) for s in steps]
    (output / "metrics.jsonl").write_text("".join(f"{row}\n" for row in rows) + '{"step": 9', encoding="utf-8")
    for step in checkpoints:
        folder = _checkpoint_dir(settings, job_id, step)
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text(json.dumps({"step": step, "metrics": {"train_loss": 1.0 / step}}))


def _running_job(settings, client, tenant, make_job):  # noqa: F811
    _tiny_config(settings)
    job_id = make_job(tenant.headers)["id"]
    store, ex, clock = _scheduler(settings)
    run_cycle(store, ex, clock=clock)
    return job_id, store


def _messages(client, tenant, job_id: str) -> list[str]:
    data = client.get(f"{JOBS}/{job_id}/events", headers=tenant.headers, params={"limit": 100}).json()["data"]
    return [e["message"] for e in reversed(data)]


def test_a_success_whose_reports_fell_short_is_completed_from_the_trainer_outputs(
        settings, client, tenant_key, make_job):  # noqa: F811
    """Killed right after its step-4 checkpoint and restarted: the reports of steps
    3-4 and of checkpoint 4 never arrived, the metrics log and the checkpoint folder have them."""
    tenant = tenant_key()
    job_id, store = _running_job(settings, client, tenant, make_job)
    _reported(settings, job_id, [1, 2, 5, 6], [2, 6], total=6)
    _trainer_wrote(settings, job_id, list(range(1, 7)), [4, 6], total=6)

    store.apply_observed([ObservedChange(job_id, ObservedKind.SUCCEEDED, message="trainer finished", attempt=1)])

    metrics = client.get(f"{JOBS}/{job_id}/metrics", headers=tenant.headers).json()["data"]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    checkpoints = client.get(f"{JOBS}/{job_id}/checkpoints", headers=tenant.headers).json()["data"]
    assert sorted(c["step_number"] for c in checkpoints) == [2, 4, 6]
    done = client.get(f"{JOBS}/{job_id}", headers=tenant.headers).json()
    assert (done["status"], done["report_gaps"]) == ("succeeded", None)
    results = client.get(f"/v1/files/{done['result_files'][0]}/content", headers=tenant.headers).text
    assert len(results.strip().splitlines()) == 1 + 6  # the results file has the recovered rows too
    assert ("Recovered from the trainer's outputs what its reports never delivered: the metrics of steps 3-4 "
            "and the checkpoint(s) of step(s) 4.") in _messages(client, tenant, job_id)


def test_a_success_with_holes_nothing_can_fill_is_flagged_on_the_job(settings, client, tenant_key, make_job):  # noqa: F811
    tenant = tenant_key()
    job_id, store = _running_job(settings, client, tenant, make_job)
    _reported(settings, job_id, [1, 2, 5], [2], total=6)
    _trainer_wrote(settings, job_id, [1, 2, 4, 5], [2], total=6)

    store.apply_observed([ObservedChange(job_id, ObservedKind.SUCCEEDED, message="trainer finished", attempt=1)])

    done = client.get(f"{JOBS}/{job_id}", headers=tenant.headers).json()
    assert done["status"] == "succeeded"
    assert done["report_gaps"] == {"missing_metric_steps": "3,6", "missing_checkpoints": [6]}
    messages = _messages(client, tenant, job_id)
    assert ("The job's records are incomplete, and the trainer's outputs cannot complete them: no metrics for "
            "steps 3,6 and no final checkpoint (step 6).") in messages, messages


def test_a_pause_resumed_before_its_run_ended_resumes_from_the_checkpoint_that_run_wrote(
        settings, client, tenant_key, make_job):  # noqa: F811
    """Paused at step 8 (a checkpoint every 4 steps), resumed at once: the pause's own
    checkpoint, step-8, is written after the resume; the job must not name step-4."""
    tenant = tenant_key()
    job_id, store = _running_job(settings, client, tenant, make_job)
    _reported(settings, job_id, list(range(1, 9)), [4], total=12)
    assert client.post(f"{JOBS}/{job_id}/pause", headers=tenant.headers).status_code == 200
    assert client.post(f"{JOBS}/{job_id}/resume", headers=tenant.headers).status_code == 200
    _trainer_wrote(settings, job_id, list(range(1, 9)), [4, 8], total=12)

    store.apply_observed([ObservedChange(job_id, ObservedKind.STOPPED, stop_reason=StopReason.PAUSE,
                                         message="trainer stopped (exit 12 (preempted))", attempt=1)])

    row = _row(settings, job_id)
    assert (row.status, row.resume_from) == ("queued", str(_checkpoint_dir(settings, job_id, 8)))
    messages = _messages(client, tenant, job_id)
    assert "Job resumed; it resumes from the checkpoint its stopping run writes." in messages, messages
    assert not any("step 4" in m or "step-4" in m for m in messages if "resume" in m.lower()), messages
    assert (f"The trainer stopped (trainer stopped (exit 12 (preempted))); the job resumes from "
            f"{_checkpoint_dir(settings, job_id, 8)}.") in messages, messages
