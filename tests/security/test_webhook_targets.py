"""Webhook targets: only public addresses, and the connection goes where the check looked.

The probe: a name that resolved to a public address when checked and to 127.0.0.1 when
the delivery connected (DNS rebinding) reached the loopback; ``100.64.0.0/10`` (shared
address space) and 6to4 addresses wrapping 127.0.0.1 passed the check.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from tests.api.conftest import start_running
from tests.security.listener import Listener

PUBLIC = "93.184.215.14"  # a global unicast address; nothing answers there from this test


@pytest.fixture
def webhooks_private_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Production target rules in this process; deliveries are recorded, not queued."""
    from control.settings import get_settings
    from control.webhooks import events

    monkeypatch.delenv("TUNEFLEET_WEBHOOK_ALLOW_PRIVATE", raising=False)
    get_settings.cache_clear()
    dispatched: list[str] = []
    events.set_dispatcher(lambda delivery_id: dispatched.append(delivery_id) or True)
    yield dispatched
    events.set_dispatcher(None)
    get_settings.cache_clear()


@pytest.mark.parametrize("url", ["http://100.64.0.1/hook", "http://100.127.255.254/hook",
                                 "http://[2002:7f00:1::1]/hook", "http://[2002:a00:1::1]/hook",
                                 "http://[64:ff9b::7f00:1]/hook",
                                 "http://224.0.0.1/hook", "http://198.18.0.1/hook"])
def test_non_global_targets_are_refused(client, tenant_key, webhooks_private_off, url) -> None:
    response = client.post("/v1/webhooks", headers=tenant_key().headers, json={"url": url})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "webhook_url_not_public"


def test_a_rebound_name_never_reaches_the_loopback(client, tenant_key, make_job, db_session, settings,
                                                   webhooks_private_off, monkeypatch) -> None:
    from control.webhooks.delivery import attempt_delivery
    from control.webhooks.models import WebhookDelivery

    real_getaddrinfo = socket.getaddrinfo
    answers: list[str] = []

    def rebinding_dns(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "hooks.rebind.test":
            return real_getaddrinfo(host, port, *args, **kwargs)
        # Public for the checks (saving the endpoint, then before the delivery), loopback after.
        address = PUBLIC if len(answers) < 2 else "127.0.0.1"
        answers.append(address)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port)))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding_dns)
    tenant = tenant_key()
    with Listener() as listener:
        created = client.post("/v1/webhooks", headers=tenant.headers,
                              json={"url": f"http://hooks.rebind.test:{listener.port}/hook"})
        assert created.status_code == 200, created.text
        start_running(db_session, make_job(tenant.headers)["id"])
        delivery_id = db_session.scalars(select(WebhookDelivery.id).where(
            WebhookDelivery.endpoint_id == created.json()["id"])).first()
        assert delivery_id is not None
        outcome = attempt_delivery(db_session, delivery_id,
                                   settings.model_copy(update={"webhook_allow_private": False, "webhook_timeout_s": 1,
                                                               "webhook_retry_base_s": 1}),
                                   service_key=settings.secret_key_value())
        db_session.commit()
        assert listener.hits == []
    assert answers == [PUBLIC, PUBLIC]  # no third lookup: the connection used the checked address
    assert outcome.attempted and outcome.status == "pending"  # nothing answered at the address


def test_pinned_requests_keep_the_host_name_for_host_header_and_tls() -> None:
    import ipaddress

    from control.webhooks.urls import pinned_request
    from trainers.common.target_urls import Target

    target = Target(url="https://hooks.example.com:8443/in?x=1", scheme="https", host="hooks.example.com",
                    port=8443, addresses=(ipaddress.ip_address(PUBLIC),))
    assert pinned_request(target) == (f"https://{PUBLIC}:8443/in?x=1", {"host": "hooks.example.com:8443"},
                                      {"sni_hostname": "hooks.example.com"})
    v6 = Target(url="http://hooks.example.com/in", scheme="http", host="hooks.example.com", port=80,
                addresses=(ipaddress.ip_address("2606:4700::1111"),))
    assert pinned_request(v6) == ("http://[2606:4700::1111]:80/in", {"host": "hooks.example.com"}, {})
