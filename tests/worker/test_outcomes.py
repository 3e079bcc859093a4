"""Run attempts on the real database: an old run's exit never moves a newer run, and the
scheduler starts a job's next attempt only once the previous trainer has stopped.

Jobs are created through the API and admitted by ``DbStore`` (the scheduler's store);
outcomes go through ``DbStore.apply_observed`` -> ``worker.outcomes.apply_outcome``, the
path both executors share.
"""

from api.db.models import Job
from api.db.session import session_scope
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
