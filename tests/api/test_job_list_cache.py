"""The cached job list (``api.jobs.pages``) and its change counter (``control.db.job_versions``).

A cached page may only be served while the tenant's jobs are unchanged. Each writer of
jobs is exercised here the way it runs in production (the API route, the lifecycle, the
report endpoint, the worker's plain ORM writes), each from its own engine and session
where another process would write, and the next list must show the write. Checked
against the code with each safeguard removed: with ``control.db.job_versions.bump`` a no-op,
every test that writes fails (7 tests x 2 databases); without the bulk-statement listener,
the bulk-update test fails; with the counter read after the rows instead of before, the
"lands while a page is built" test fails; with the tenant taken from the attribute history
only (an expired ``tenant_id`` has none), the plain-ORM-write test fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from api.jobs import pages as job_pages
from api.jobs.commands import issue_job_token
from api.jobs.pages import JobPageCache, PageKey
from api.jobs.schemas import JobPublic, JobsPublic
from control.db.job_versions import job_list_version, read_job_list_version
from control.db.models import Job
from control.db.session import get_engine, session_scope
from control.jobs.lifecycle import transition

LIST = "/v1/fine_tuning/jobs"


@pytest.fixture
def other_process(settings) -> Iterator[sessionmaker[Session]]:
    """Sessions on an engine of their own, as another API replica or the worker has."""
    engine = create_engine(settings.resolved_database_url)
    yield sessionmaker(bind=engine, expire_on_commit=False)
    engine.dispose()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts how often the route built a page and how often the fast path answered.

    The fast path needs the caller's key in the key cache, whose entries live 5 s: on a
    loaded machine two requests of a test have come more than 5 s apart, and the second was
    built again. Here the entries live as long as the test (revocations still remove them
    at once), so the counts say what the page cache did, not how busy the machine was."""
    import api.jobs.queries
    import control.auth

    monkeypatch.setattr(control.auth.key_cache, "ttl_s", 600.0)

    calls = {"built": 0, "fast": 0}
    build = api.jobs.queries.list_jobs

    def counting_build(*args: Any, **kwargs: Any) -> Any:
        calls["built"] += 1
        return build(*args, **kwargs)

    async def counting_fast(self: Any, scope: Any) -> Any:
        body = await fast(self, scope)
        calls["fast"] += body is not None
        return body

    fast = job_pages.CachedJobListMiddleware._current_page
    monkeypatch.setattr(api.jobs.queries, "list_jobs", counting_build)
    monkeypatch.setattr(job_pages.CachedJobListMiddleware, "_current_page", counting_fast)
    return calls


def _ids(client: Any, headers: dict[str, str], **params: Any) -> list[str]:
    answer = client.get(LIST, headers=headers, params=params)
    assert answer.status_code == 200, answer.text
    return [j["id"] for j in answer.json()["data"]]


def _job(client: Any, headers: dict[str, str], job_id: str) -> dict[str, Any]:
    page = client.get(LIST, headers=headers).json()
    return next(j for j in page["data"] if j["id"] == job_id)


def test_repeated_list_is_served_from_cache_and_equals_the_model(
    client, settings, tenant_key, make_job, counted
):
    user = tenant_key()
    made = [make_job(user.headers, metadata={"run": str(i)})["id"] for i in range(3)]
    first = client.get(LIST, headers=user.headers, params={"limit": 2})
    again = client.get(LIST, headers=user.headers, params={"limit": 2})
    assert counted == {"built": 1, "fast": 1}
    assert again.content == first.content
    for header in ("content-type", "content-length"):
        assert again.headers[header] == first.headers[header]
    with session_scope(settings.resolved_database_url) as session:
        jobs = [session.get_one(Job, job_id) for job_id in reversed(made)]
        expected = JobsPublic(data=[JobPublic.of(j) for j in jobs[:2]], has_more=True,
                              first_id=jobs[0].id, last_id=jobs[1].id)
    assert again.json() == expected.model_dump(mode="json")


def test_every_query_parameter_is_part_of_the_key(client, tenant_key, make_job, counted):
    user = tenant_key()
    a = make_job(user.headers, metadata={"team": "a"})["id"]
    b = make_job(user.headers, metadata={"team": "b"})["id"]
    c = make_job(user.headers, metadata={"team": "a"})["id"]
    client.post(f"{LIST}/{b}/cancel", headers=user.headers)
    expected = {
        (): [c, b, a],
        (("limit", 1),): [c],
        (("limit", 2),): [c, b],
        (("after", c),): [b, a],
        (("after", b),): [a],
        (("metadata[team]", "a"),): [c, a],
        (("metadata[team]", "b"),): [b],
        (("status", "cancelled"),): [b],
        (("status", "queued"),): [c, a],
        (("status", "queued"), ("limit", 1)): [c],
    }
    for _ in range(2):  # built, then served from the cache: the same answers
        for params, ids in expected.items():
            assert _ids(client, user.headers, **dict(params)) == ids, params
    assert counted["built"] == len(expected) and counted["fast"] == len(expected)


def test_a_created_job_shows_in_the_next_list(client, tenant_key, make_job):
    user = tenant_key()
    first = make_job(user.headers)["id"]
    assert _ids(client, user.headers) == [first]
    second = make_job(user.headers)["id"]  # the create route
    assert _ids(client, user.headers) == [second, first]


def test_a_transition_shows_in_the_next_list(client, tenant_key, make_job, other_process):
    user = tenant_key()
    job = make_job(user.headers)["id"]
    assert _job(client, user.headers, job)["status"] == "queued"
    client.post(f"{LIST}/{job}/pause", headers=user.headers)  # the lifecycle, via the API
    assert _job(client, user.headers, job)["status"] == "paused"
    with other_process() as session:  # the lifecycle, from the worker's process
        row = session.get_one(Job, job)
        transition(session, row, "queued", actor="system")
        session.commit()
    assert _job(client, user.headers, job)["status"] == "queued"


def test_a_trainer_report_shows_in_the_next_list(client, tenant_key, make_job, other_process):
    user = tenant_key()
    job = make_job(user.headers)["id"]
    with other_process() as session:
        row = session.get_one(Job, job)
        token = issue_job_token(session, row)
        transition(session, row, "running", actor="scheduler")
        session.commit()
    assert _job(client, user.headers, job)["current_step"] is None
    answer = client.post(f"/internal/v1/jobs/{job}/reports", headers={"Authorization": f"Bearer {token}"},
                         json={"seq": 1, "items": [{"type": "metric", "step": 3, "total_steps": 9,
                                                    "tokens_seen": 300}]})
    assert answer.status_code == 200, answer.text
    shown = _job(client, user.headers, job)
    assert (shown["current_step"], shown["total_steps"], shown["trained_tokens"]) == (3, 9, 300)


def test_a_plain_orm_write_from_another_process_shows_in_the_next_list(
    client, tenant_key, make_job, other_process
):
    """The worker and scheduler also set columns directly (queue_reason, usage, restarts)."""
    user = tenant_key()
    job = make_job(user.headers)["id"]
    assert _job(client, user.headers, job)["queue_reason"] is None
    with other_process() as session:
        session.get_one(Job, job).queue_reason = "waiting for 8 GPUs in pool a100"
        session.commit()
    assert _job(client, user.headers, job)["queue_reason"] == "waiting for 8 GPUs in pool a100"
    with other_process() as session:
        row = session.get_one(Job, job)
        session.expire(row)  # its tenant_id is not loaded when the write is flushed
        row.restarts = 2
        session.commit()
    assert _job(client, user.headers, job)["restarts"] == 2


def test_a_bulk_update_and_a_delete_show_in_the_next_list(
    client, tenant_key, make_job, other_process
):
    user = tenant_key()
    kept, dropped = make_job(user.headers)["id"], make_job(user.headers)["id"]
    assert _ids(client, user.headers) == [dropped, kept]
    with other_process() as session:  # cannot name its tenants: every tenant is bumped
        session.execute(update(Job).where(Job.id == kept).values(queue_reason="bulk"))
        session.commit()
    assert _job(client, user.headers, kept)["queue_reason"] == "bulk"
    with other_process() as session:
        session.delete(session.get_one(Job, dropped))
        session.commit()
    assert _ids(client, user.headers) == [kept]


def test_a_write_that_lands_while_a_page_is_built_is_not_hidden(
    client, tenant_key, make_job, other_process, monkeypatch
):
    """The counter is read before the rows: a write committed after the rows were read
    bumps past the counter the page was stored under, so the next request rebuilds."""
    import api.jobs.queries

    user = tenant_key()
    job = make_job(user.headers)["id"]
    build = api.jobs.queries.list_jobs

    def build_then_write(*args: Any, **kwargs: Any) -> Any:
        page = build(*args, **kwargs)
        with other_process() as session:
            session.get_one(Job, job).queue_reason = "written meanwhile"
            session.commit()
        monkeypatch.setattr(api.jobs.queries, "list_jobs", build)
        return page

    monkeypatch.setattr(api.jobs.queries, "list_jobs", build_then_write)
    assert _job(client, user.headers, job)["queue_reason"] is None  # read before the write
    assert _job(client, user.headers, job)["queue_reason"] == "written meanwhile"


def test_tenants_neither_invalidate_nor_see_each_others_pages(
    client, settings, tenant_key, make_job, counted
):
    alice, bob = tenant_key(), tenant_key()
    alice_job = make_job(alice.headers)["id"]
    bob_job = make_job(bob.headers)["id"]
    url = settings.resolved_database_url
    with session_scope(url) as session:
        alice_version = job_list_version(session, alice.tenant_id)
    assert _ids(client, alice.headers) == [alice_job]
    assert _ids(client, bob.headers) == [bob_job]  # the same query string, bob's own page
    built = counted["built"]

    newer = make_job(bob.headers)["id"]
    client.post(f"{LIST}/{bob_job}/cancel", headers=bob.headers)
    with session_scope(url) as session:
        assert job_list_version(session, alice.tenant_id) == alice_version
        assert job_list_version(session, bob.tenant_id) > 0
    assert _ids(client, alice.headers) == [alice_job]  # still cached: bob wrote, not alice
    assert counted["built"] == built
    assert _ids(client, bob.headers) == [newer, bob_job]
    assert counted["built"] == built + 1


def test_a_rolled_back_write_bumps_nothing(tenant_key, make_job, settings, other_process):
    user = tenant_key()
    job = make_job(user.headers)["id"]
    engine = get_engine(settings.resolved_database_url)
    before = read_job_list_version(engine, user.tenant_id)
    with other_process() as session:
        session.get_one(Job, job).queue_reason = "never committed"
        session.flush()
        session.rollback()
        session.commit()  # a later commit in the same session: nothing left to bump
    with other_process() as session:
        session.get_one(Job, job)  # read only
        session.commit()
    assert read_job_list_version(engine, user.tenant_id) == before
    with session_scope(settings.resolved_database_url) as session:
        assert job_list_version(session, user.tenant_id) == before  # both readers agree


def test_unauthenticated_and_revoked_keys_are_never_served_from_the_cache(
    client, settings, tenant_key, admin_key, make_job, counted
):
    user = tenant_key()
    make_job(user.headers)
    for _ in range(2):
        assert client.get(LIST, headers=user.headers).status_code == 200
    assert counted["fast"] == 1
    for headers in ({}, {"Authorization": "Bearer tf_abcdefgh_" + "x" * 32}):
        assert client.get(LIST, headers=headers).status_code == 401
    with session_scope(settings.resolved_database_url) as session:
        from control.db.models import ApiKey
        from control.ids import hash_secret

        key_id = session.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_secret(user.key)))
    assert client.delete(f"/v1/admin/api_keys/{key_id}",
                         headers={"Authorization": f"Bearer {admin_key}"}).status_code == 200
    assert client.get(LIST, headers=user.headers).status_code == 401
    assert counted["fast"] == 1


def test_page_cache_is_bounded_in_bytes_and_checks_the_counter():
    cache = JobPageCache(max_bytes=10)
    one, two = PageKey("org-a", b""), PageKey("org-a", b"limit=1")
    cache.put(one, 1, b"123456")
    assert cache.get(one, 1) == b"123456"
    assert cache.get(one, 2) is None and cache.get(one, None) is None
    cache.put(two, None, b"abcdef")  # 12 bytes > 10: the least recently used goes
    assert cache.get(one, 1) is None and cache.get(two, None) == b"abcdef"
    cache.put(one, 1, b"x" * 11)  # larger than the whole cache: not stored
    assert cache.peek(one) is None and len(cache) == 1


def test_cached_answers_are_measured_under_the_list_route(client, tenant_key, make_job, counted):
    from prometheus_client import REGISTRY

    def observed() -> float:
        labels = {"method": "GET", "route": LIST, "status": "200"}
        return REGISTRY.get_sample_value("tunefleet_http_request_duration_seconds_count",
                                         labels) or 0.0

    user = tenant_key()
    make_job(user.headers)
    client.get(LIST, headers=user.headers)
    before = observed()
    client.get(LIST, headers=user.headers)
    assert counted["fast"] == 1
    assert observed() == before + 1
