"""DbStore's queue read and the jobs' settings: each queued job's settings are parsed from
its row (``control.job_settings``), again whenever its settings columns changed, and a row
whose settings cannot be read waits with the reason instead of stopping the cycle.

Jobs are created through the real API; rows are then changed underneath, as another
writer (or an older version) might have left them.
"""

from __future__ import annotations

from control.db.models import Job
from control.db.session import session_scope
from scheduling.pools import local_pool
from tests.api.conftest import make_job, processed_file, upload  # noqa: F401 (fixtures)
from tests.worker.test_db_store import _tiny_config
from worker.scheduler.store import DbStore


def _set(settings, job_id: str, **columns) -> None:
    with session_scope(settings.resolved_database_url) as session:
        job = session.get_one(Job, job_id)
        for name, value in columns.items():
            setattr(job, name, value)
        session.commit()


def _requests(store: DbStore) -> dict:
    return {request.job_id: request for request in store.queued()}


def test_a_job_is_placed_by_its_settings_as_they_are_now(settings, tenant_key, make_job):  # noqa: F811
    _tiny_config(settings)
    job_id = make_job(tenant_key().headers)["id"]
    store = DbStore(settings, [local_pool(slots=1)])
    first = _requests(store)[job_id]
    assert (first.gpus, first.training.r, first.training.method) == (None, 8, "lora")
    _set(settings, job_id, placement={"gpus": 2}, adapter={"method": "qlora", "r": 16})
    again = _requests(store)[job_id]
    assert (again.gpus, again.training.r, again.training.method, again.training.quantization) == (
        2, 16, "qlora", "nf4")


def test_a_row_whose_settings_cannot_be_read_waits_and_the_others_are_placed(
        settings, tenant_key, make_job):  # noqa: F811
    _tiny_config(settings)
    headers = tenant_key().headers
    bad, good = make_job(headers)["id"], make_job(headers)["id"]
    _set(settings, bad, adapter={"method": "lora", "r": "many"})
    store = DbStore(settings, [local_pool(slots=1)])
    assert list(_requests(store)) == [good]
    with session_scope(settings.resolved_database_url) as session:
        reason = session.get_one(Job, bad).queue_reason
    assert reason.startswith("waiting: its stored settings cannot be read (adapter.r:"), reason
