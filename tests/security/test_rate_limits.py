"""Rate limits on ``/v1/*``, ``/internal/*`` and ``/ui/login`` (api/rate_limits.py).

The probe: 300 bad keys in 0.9 s and 50 failed dashboard sign-ins were all plain 401s.
Each test builds the real app with tight limits and talks to it as one or more client
addresses (``TestClient(client=...)`` sets the ASGI scope's peer address).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import free_port, make_settings

BAD_KEY = {"Authorization": "Bearer tf_abcdefgh_" + "x" * 32}


@pytest.fixture
def limited_client(settings, inline_queue) -> Iterator[Callable[..., TestClient]]:
    """``make(ip, **settings)``: a client at ``ip`` of an app built with those settings
    (the same app for the same settings, so clients at several addresses share counters)."""
    from api.main import create_app

    apps: dict[tuple[tuple[str, Any], ...], Any] = {}
    with ExitStack() as stack:
        def make(ip: str = "203.0.113.7", **overrides: Any) -> TestClient:
            values = {"rate_limit_enabled": True, **overrides}
            key = tuple(sorted(values.items()))
            if key not in apps:
                tuned = make_settings(settings.data_path, **values)
                apps[key] = create_app(tuned, queue=inline_queue)
            return stack.enter_context(
                TestClient(apps[key], raise_server_exceptions=False, client=(ip, 40000)))

        yield make


def assert_rate_limited(answer: Any) -> None:
    assert answer.status_code == 429, answer.text
    assert answer.json() == {"error": {
        "message": answer.json()["error"]["message"], "type": "rate_limit_error",
        "param": None, "code": "rate_limited"}}
    assert "retry" in answer.json()["error"]["message"].lower()
    assert re.fullmatch(r"[1-9][0-9]*", answer.headers["retry-after"])
    assert int(answer.headers["retry-after"]) <= 60


def test_failed_keys_from_one_ip_are_refused_after_the_limit(limited_client, tenant_key) -> None:
    client = limited_client(rate_limit_failed_auth_per_min=5)
    for _ in range(5):
        assert client.get("/v1/files", headers=BAD_KEY).status_code == 401
    assert_rate_limited(client.get("/v1/files", headers=BAD_KEY))
    # Over the limit, the IP is refused before any key is looked at, even a valid one.
    assert_rate_limited(client.get("/v1/files", headers=tenant_key().headers))
    assert_rate_limited(client.get("/v1/files"))


def test_a_valid_key_is_unaffected_by_another_ips_failures(limited_client, tenant_key) -> None:
    attacker = limited_client("198.51.100.1", rate_limit_failed_auth_per_min=3)
    user = limited_client("198.51.100.2", rate_limit_failed_auth_per_min=3)
    for _ in range(3):
        assert attacker.get("/v1/files", headers=BAD_KEY).status_code == 401
    assert attacker.get("/v1/files", headers=BAD_KEY).status_code == 429
    key = tenant_key()
    for _ in range(5):
        assert user.get("/v1/files", headers=key.headers).status_code == 200


def test_missing_keys_and_bad_job_tokens_count_as_failed_auth(limited_client) -> None:
    client = limited_client(rate_limit_failed_auth_per_min=3)
    assert client.get("/v1/files").status_code == 401
    assert client.post("/internal/v1/jobs/ftjob-x/reports", json={"seq": 1, "items": []},
                       headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/fine_tuning/jobs", headers=BAD_KEY).status_code == 401
    assert_rate_limited(client.post("/internal/v1/jobs/ftjob-x/reports", json={"seq": 1, "items": []},
                                    headers={"Authorization": "Bearer wrong"}))


def test_failed_dashboard_sign_ins_are_refused_after_the_limit(limited_client) -> None:
    client = limited_client(rate_limit_failed_auth_per_min=4)
    page = client.get("/ui/login")
    for _ in range(4):
        # Each answer is a fresh form with a fresh sign-in token.
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        page = client.post("/ui/login", data={"api_key": "tf_nope", "csrf_token": token},
                           follow_redirects=False)
        assert page.status_code == 401
    token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    assert_rate_limited(client.post("/ui/login", data={"api_key": "tf_nope", "csrf_token": token},
                                    follow_redirects=False))


def test_the_per_key_limit_refuses_that_key_only(limited_client, tenant_key) -> None:
    client = limited_client(rate_limit_requests_per_min=4)
    busy, other = tenant_key(), tenant_key()
    for _ in range(4):
        assert client.get("/v1/files", headers=busy.headers).status_code == 200
    assert_rate_limited(client.get("/v1/files", headers=busy.headers))
    assert client.get("/v1/files", headers=other.headers).status_code == 200


def test_a_forged_key_with_a_real_prefix_does_not_spend_that_keys_budget(
        limited_client, tenant_key) -> None:
    key = tenant_key()
    forged = {"Authorization": f"Bearer {key.key[:-6]}forged"}
    attacker = limited_client("192.0.2.66", rate_limit_requests_per_min=2)
    user = limited_client("192.0.2.67", rate_limit_requests_per_min=2)
    assert user.get("/v1/files", headers=key.headers).status_code == 200
    assert [attacker.get("/v1/files", headers=forged).status_code for _ in range(4)] == [401] * 4
    assert user.get("/v1/files", headers=key.headers).status_code == 200
    assert_rate_limited(user.get("/v1/files", headers=key.headers))


def test_a_forged_key_on_unknown_routes_never_spends_the_real_keys_budget(
        limited_client, tenant_key) -> None:
    """The probe: 1,210 forged keys carrying bob's prefix, each answered 404 (no route
    authenticates an unknown path), locked bob out for the minute."""
    key = tenant_key()
    forged = {"Authorization": f"Bearer {key.key[:-6]}forged"}
    attacker = limited_client("192.0.2.70", rate_limit_requests_per_min=3)
    user = limited_client("192.0.2.71", rate_limit_requests_per_min=3)
    answers = [attacker.get("/v1/no-such-route", headers=forged).status_code for _ in range(5)]
    # The forger's unverified requests count against its own address.
    assert answers[:3] == [404] * 3 and answers[3:] == [429] * 2
    assert [user.get("/v1/files", headers=key.headers).status_code for _ in range(3)] == [200] * 3
    assert_rate_limited(user.get("/v1/files", headers=key.headers))


def test_failed_authentications_count_by_the_presented_key_too(limited_client, tenant_key) -> None:
    """A forged key sent from many addresses is refused once it failed the limit's number of
    times, whatever address sends it next; the real key it imitates is not."""
    key = tenant_key()
    forged = {"Authorization": f"Bearer {key.key[:-6]}forged"}
    for n in range(3):
        bot = limited_client(f"198.51.100.{10 + n}", rate_limit_failed_auth_per_min=3)
        assert bot.get("/v1/files", headers=forged).status_code == 401
    assert_rate_limited(limited_client("198.51.100.20", rate_limit_failed_auth_per_min=3)
                        .get("/v1/files", headers=forged))
    user = limited_client("198.51.100.21", rate_limit_failed_auth_per_min=3)
    assert user.get("/v1/files", headers=key.headers).status_code == 200


def test_unauthenticated_traffic_to_the_report_route_never_spends_the_trainers_budget(
        limited_client, tenant_key, make_job, db_session, client) -> None:
    """The probe: ~600 unauthenticated GETs of a job's report route (405 each) made the
    job's own trainer get 429."""
    from tests.api.conftest import start_running

    owner = tenant_key()
    job = make_job(owner.headers)
    _, token = start_running(db_session, job["id"])
    path = f"/internal/v1/jobs/{job['id']}/reports"
    stranger = limited_client("203.0.113.90", rate_limit_reports_per_min=3, rate_limit_requests_per_min=3)
    trainer = limited_client("10.8.0.3", rate_limit_reports_per_min=3, rate_limit_requests_per_min=3)
    assert [stranger.get(path).status_code for _ in range(5)] == [405] * 3 + [429] * 2
    posted = [trainer.post(path, json={"seq": seq, "items": []},
                           headers={"Authorization": f"Bearer {token}"}).status_code for seq in range(4)]
    assert posted == [200] * 3 + [429]


def test_unauthenticated_routes_are_limited_per_ip(limited_client) -> None:
    first = limited_client("192.0.2.1", rate_limit_requests_per_min=3)
    second = limited_client("192.0.2.2", rate_limit_requests_per_min=3)
    for _ in range(3):
        assert first.get("/ui/login").status_code == 200
    assert_rate_limited(first.get("/ui/login"))
    assert second.get("/ui/login").status_code == 200
    # Routes outside the covered prefixes are never limited.
    for _ in range(5):
        assert first.get("/healthz").status_code == 200


def test_forwarded_for_is_read_only_from_a_trusted_proxy(limited_client) -> None:
    proxy = limited_client("10.0.0.5", rate_limit_failed_auth_per_min=2,
                           rate_limit_trusted_proxies="10.0.0.5")
    for _ in range(2):
        answer = proxy.get("/v1/files", headers={**BAD_KEY, "X-Forwarded-For": "198.51.100.77"})
        assert answer.status_code == 401
    assert proxy.get("/v1/files", headers={**BAD_KEY, "X-Forwarded-For": "198.51.100.77"}).status_code == 429
    # Another client behind the same proxy (with another bad key: the first one is spent) has its own count.
    other_key = {"Authorization": "Bearer tf_zyxwvuts_" + "y" * 32}
    assert proxy.get("/v1/files", headers={**other_key, "X-Forwarded-For": "198.51.100.78"}).status_code == 401
    # An untrusted peer cannot pick its address: it is counted as itself.
    direct = limited_client("198.51.100.50", rate_limit_failed_auth_per_min=2,
                            rate_limit_trusted_proxies="10.0.0.5")
    third_key = {"Authorization": "Bearer tf_qponmlkj_" + "z" * 32}
    for n in range(3):
        spoofed = {**third_key, "X-Forwarded-For": f"192.0.2.{n}"}
        assert direct.get("/v1/files", headers=spoofed).status_code == (401 if n < 2 else 429)


def test_the_switch_turns_limiting_off(limited_client) -> None:
    on = limited_client(rate_limit_failed_auth_per_min=1)
    assert [on.get("/v1/files", headers=BAD_KEY).status_code for _ in range(3)] == [401, 429, 429]
    off = limited_client(rate_limit_enabled=False, rate_limit_failed_auth_per_min=1)
    assert [off.get("/v1/files", headers=BAD_KEY).status_code for _ in range(3)] == [401] * 3


def test_redis_counters_are_shared_by_every_replica(limited_client, redis_url, tenant_key) -> None:
    prefix = f"test-rate-limits-{uuid.uuid4().hex}"
    replica_a = limited_client(broker_url=redis_url, rate_limit_key_prefix=prefix,
                               rate_limit_failed_auth_per_min=3)
    for _ in range(3):
        assert replica_a.get("/v1/files", headers=BAD_KEY).status_code == 401
    # A second app on the same Redis (another replica) sees the same count.
    replica_b = limited_client(broker_url=redis_url, rate_limit_key_prefix=prefix,
                               rate_limit_failed_auth_per_min=3, rate_limit_requests_per_min=1000)
    assert_rate_limited(replica_b.get("/v1/files", headers=BAD_KEY))

    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        assert client.keys(f"{prefix}*"), "the counters are not in Redis"
    finally:
        client.close()
    # With another prefix (another deployment on the same Redis) nothing is counted yet.
    fresh = limited_client(broker_url=redis_url, rate_limit_key_prefix=prefix + "-other",
                           rate_limit_failed_auth_per_min=3)
    assert fresh.get("/v1/files", headers=tenant_key().headers).status_code == 200


def test_an_unreachable_redis_lets_requests_through(limited_client, tenant_key, caplog) -> None:
    closed = f"redis://127.0.0.1:{free_port()}/0"
    client = limited_client(broker_url=closed, rate_limit_failed_auth_per_min=1,
                            rate_limit_requests_per_min=1)
    key = tenant_key()
    with caplog.at_level("WARNING", logger="api.rate_limits"):
        assert [client.get("/v1/files", headers=BAD_KEY).status_code for _ in range(3)] == [401] * 3
        assert [client.get("/v1/files", headers=key.headers).status_code for _ in range(3)] == [200] * 3
    assert any("rate limit" in record.getMessage() for record in caplog.records)


def test_the_document_lists_the_429_on_every_limited_route(client) -> None:
    document = client.get("/openapi.json").json()
    limited = []
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if path.startswith(("/v1/", "/internal/")):
                response = operation["responses"]["429"]
                assert response["content"] == {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
                assert "Retry-After" in response["headers"]
                limited.append(f"{method} {path}")
            else:
                assert "429" not in operation["responses"], path
    assert "post /internal/v1/jobs/{job_id}/reports" in limited and len(limited) > 10


def test_trusted_proxies_must_be_addresses(tmp_path) -> None:
    with pytest.raises(ValueError, match="TUNEFLEET_RATE_LIMIT_TRUSTED_PROXIES: 'proxy.internal'"):
        make_settings(tmp_path, rate_limit_trusted_proxies="10.0.0.7, proxy.internal")
    tuned = make_settings(tmp_path, rate_limit_trusted_proxies="10.0.0.7, 10.1.0.0/16")
    assert [str(n) for n in tuned.trusted_proxies] == ["10.0.0.7/32", "10.1.0.0/16"]
