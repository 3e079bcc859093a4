"""The API's hot read path: the API-key cache and ``GET /v1/fine_tuning/jobs``.

The key cache must never widen access: a revoked key stops working at once in the
process that revoked it and within ``KEY_CACHE_TTL_S`` elsewhere; tenants stay isolated;
a cached key costs no database round trip. The list route serializes the page itself,
so its body is checked against the ``JobsPublic`` model that documents it.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event, select, update

from api.jobs.pages import JobPageCache
from api.jobs.schemas import JobPublic, JobsPublic
from control import auth
from control.auth import KeyCache
from control.db.models import ApiKey, Job
from control.db.session import get_engine, session_scope
from control.ids import hash_secret

LIST = "/v1/fine_tuning/jobs"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """A fresh process-wide key cache driven by a fake clock."""
    fake = FakeClock()
    monkeypatch.setattr(auth, "key_cache", KeyCache(ttl_s=5.0, clock=fake))
    return fake


def _key_id(settings: Any, raw: str) -> str:
    with session_scope(settings.resolved_database_url) as session:
        return session.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_secret(raw)))


def _statements(settings: Any) -> list[str]:
    """A list that collects every SQL statement the app's engine runs from now on."""
    seen: list[str] = []
    engine = get_engine(settings.resolved_database_url)

    def record(_conn, _cursor, statement, *_args) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    return seen


def test_revoked_key_stops_at_once_in_this_process(client, settings, tenant_key, admin_key, clock):
    user = tenant_key()
    assert client.get(LIST, headers=user.headers).status_code == 200
    assert auth.key_cache.get(get_engine(settings.resolved_database_url).url,
                              hash_secret(user.key)) is not None  # the key is cached now

    revoked = client.delete(f"/v1/admin/api_keys/{_key_id(settings, user.key)}",
                            headers={"Authorization": f"Bearer {admin_key}"})
    assert revoked.status_code == 200, revoked.text

    # Same process, same instant: no TTL to wait for.
    answer = client.get(LIST, headers=user.headers)
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "invalid_api_key"


def test_key_revoked_elsewhere_stops_within_the_ttl(client, settings, tenant_key, clock):
    user = tenant_key()
    assert client.get(LIST, headers=user.headers).status_code == 200
    # Another process (a second replica, the CLI) revokes the row directly: this
    # process's cache cannot hear about it.
    with session_scope(settings.resolved_database_url) as session:
        session.execute(update(ApiKey).where(ApiKey.key_hash == hash_secret(user.key))
                        .values(revoked_at=ApiKey.created_at))
    clock.now += 4.9
    assert client.get(LIST, headers=user.headers).status_code == 200  # the documented window
    clock.now += 0.2
    assert client.get(LIST, headers=user.headers).status_code == 401


def test_cached_key_needs_no_query_and_lists_only_its_tenant(
    client, settings, tenant_key, make_job, clock
):
    alice, bob = tenant_key(), tenant_key()
    alice_job = make_job(alice.headers)["id"]
    bob_job = make_job(bob.headers)["id"]
    for who in (alice, bob):  # both keys cached
        assert client.get(LIST, headers=who.headers).status_code == 200

    client.app.state.job_pages = JobPageCache()  # the route builds the page, not the page cache
    statements = _statements(settings)
    alice_page = client.get(LIST, headers=alice.headers).json()
    assert [j["id"] for j in alice_page["data"]] == [alice_job]
    # The list's own statements only (its change counter, then the page): the key and
    # its tenant came from the key cache.
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert [("job_list_versions" in s, "FROM jobs" in s) for s in selects] == [
        (True, False), (False, True)], statements
    assert all("api_keys" not in s and "tenants" not in s for s in statements), statements

    bob_page = client.get(LIST, headers=bob.headers).json()
    assert [j["id"] for j in bob_page["data"]] == [bob_job]
    # Isolation on the other routes holds with cached keys too (404, not 403).
    assert client.get(f"{LIST}/{bob_job}", headers=alice.headers).status_code == 404
    assert client.post(f"{LIST}/{bob_job}/cancel", headers=alice.headers).status_code == 404


def test_cached_admin_key_keeps_admin_rights_and_tenant_keys_do_not_gain_them(
    client, tenant_key, admin_key, clock
):
    user = tenant_key()
    admin = {"Authorization": f"Bearer {admin_key}"}
    for _ in range(2):  # first from the database, then from the cache
        assert client.get("/v1/admin/tenants", headers=admin).status_code == 200
        denied = client.get("/v1/admin/tenants", headers=user.headers)
        assert denied.status_code == 403
        assert denied.json()["error"]["code"] == "permission_denied"


def test_unknown_and_malformed_keys_are_refused_and_never_cached(client, clock):
    for header in ("Bearer tf_abcdefgh_" + "x" * 32, "Bearer nonsense", "Basic abc"):
        for _ in range(2):
            answer = client.get(LIST, headers={"Authorization": header})
            assert answer.status_code == 401
            assert answer.json()["error"]["code"] == "invalid_api_key"
    assert auth.key_cache._entries == {}


def test_a_lookup_that_raced_a_revocation_is_not_cached(client, settings, tenant_key, clock):
    user = tenant_key()
    url = get_engine(settings.resolved_database_url).url
    with session_scope(settings.resolved_database_url) as session:
        key = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_secret(user.key)))
        key.tenant  # noqa: B018 - loaded, as authenticate loads it
        generation = auth.key_cache.generation
        auth.key_cache.invalidate(key.key_hash)  # a revocation lands while we read
        auth.key_cache.put(url, key, generation=generation)
        assert auth.key_cache.get(url, key.key_hash) is None
        auth.key_cache.put(url, key, generation=auth.key_cache.generation)
        assert auth.key_cache.get(url, key.key_hash) is not None


def test_cache_is_per_database():
    cache = KeyCache(ttl_s=5.0, clock=FakeClock())
    from sqlalchemy import make_url

    from control.db.models import Tenant

    tenant = Tenant(id="org-a", name="a", is_admin=False)
    key = ApiKey(id="key-a", tenant_id="org-a", prefix="abcdefgh", key_hash="h" * 64,
                 is_admin=False, tenant=tenant)
    cache.put(make_url("sqlite:///one.db"), key, generation=cache.generation)
    assert cache.get(make_url("sqlite:///one.db"), "h" * 64) is not None
    assert cache.get(make_url("sqlite:///two.db"), "h" * 64) is None


def test_list_body_matches_the_documented_model(client, settings, tenant_key, make_job):
    user = tenant_key()
    made = [make_job(user.headers, metadata={"run": str(i)}, suffix=f"s{i}")["id"] for i in range(3)]
    page = client.get(LIST, headers=user.headers, params={"limit": 2})
    assert page.status_code == 200
    assert page.headers["content-type"] == "application/json"
    body = page.json()
    with session_scope(settings.resolved_database_url) as session:
        jobs = [session.get_one(Job, job_id) for job_id in reversed(made)]
        expected = JobsPublic(data=[JobPublic.of(j) for j in jobs[:2]], has_more=True,
                              first_id=jobs[0].id, last_id=jobs[1].id)
    assert body == expected.model_dump(mode="json")
    assert body["data"][0]["object"] == "fine_tuning.job" and body["has_more"] is True
    rest = client.get(LIST, headers=user.headers, params={"after": body["last_id"]}).json()
    assert [j["id"] for j in rest["data"]] == [made[0]] and rest["has_more"] is False


def test_json_column_parser_matches_the_standard_library():
    """JSON columns are parsed by pydantic-core (``control.db.session._json_loads``); the
    stdlib ``json`` module is the reference, including what pydantic-core refuses."""
    import json
    import random

    from control.db.session import _json_loads

    rng = random.Random(7)
    docs = [
        '{"n_epochs": 3, "learning_rate": 0.0001, "target_modules": ["q_proj", "v_proj"]}',
        '{"nested": {"a": [1, 2.5, null, true, false, "x"]}, "empty": {}, "list": []}',
        '"caf\\u00e9 \\ud83d\\ude00 \\u4e2d"', '"\\ud800 lone surrogate"', "null", "1e400",
        '{"a": 1, "a": 2}', "-0.0", str(2**80),
        *(json.dumps([rng.random() * 10 ** rng.randint(-300, 300), rng.randint(-2**63, 2**63)])
          for _ in range(2000)),
    ]
    for doc in docs:
        for data in (doc, doc.encode()):  # SQLite hands over str, psycopg bytes
            assert _json_loads(data) == json.loads(data), doc
