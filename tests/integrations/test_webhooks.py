"""Signed webhooks end to end: API, transactional outbox, Celery delivery, receiver.

The receiver verifies every request with the ``standardwebhooks`` package (the spec's
reference library), not with our signing code.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from tests.conftest import REPO, settings_env
from tests.integrations.webhook_receiver import Receiver
from tests.sdk.conftest import (
    DEMO_MODEL,
    JobDriver,
    Service,
    cached_settings_env,
    chat_jsonl,
    queued_job,
)
from tunefleet import BadRequestError, NotFoundError, Tunefleet


@pytest.fixture
def webhook_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Set ``TUNEFLEET_WEBHOOK_*`` for this process (the settings are cached: reset them)."""
    from control.settings import get_settings
    from control.webhooks import events

    with cached_settings_env(monkeypatch, "TUNEFLEET_WEBHOOK_", get_settings) as set_env:
        yield set_env
    events.set_dispatcher(None)


@pytest.fixture
def dispatched(webhook_env: Any) -> list[str]:
    """Receivers on this machine allowed, and the delivery ids the service hands to its
    queue after each commit, recorded instead of sent: the test runs each attempt itself."""
    from control.webhooks import events

    webhook_env(allow_private="true")
    ids: list[str] = []
    events.set_dispatcher(lambda delivery_id: ids.append(delivery_id) or True)
    return ids


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def sdk(service: Service) -> Iterator[Tunefleet]:
    with Tunefleet(base_url=service.base_url, api_key=service.key) as client:
        yield client


def test_endpoint_crud_validation_and_isolation(sdk: Tunefleet, webhook_env: Any, receiver: Receiver,
                                                service: Service, tenant_key: Any) -> None:
    for url, code in [
        (receiver.url, "webhook_url_not_public"),
        ("http://10.1.2.3/hook", "webhook_url_not_public"),
        ("http://169.254.169.254/latest", "webhook_url_not_public"),
        ("http://[::1]:9/x", "webhook_url_not_public"),
        ("http://localhost:8080/x", "webhook_url_not_public"),
        ("ftp://example.com/x", "invalid_webhook_url"),
        ("http://user:pw@example.com/x", "invalid_webhook_url"),
    ]:
        with pytest.raises(BadRequestError) as exc:
            sdk.webhooks.create(url=url)
        assert (exc.value.code, exc.value.param) == (code, "url"), url
    with pytest.raises(BadRequestError) as bad_event:
        sdk.webhooks.create(url="https://example.com/x", events=["fine_tuning.job.exploded"])
    assert bad_event.value.param.startswith("events")

    webhook_env(allow_private="true")
    ep = sdk.webhooks.create(url=receiver.url, events=["fine_tuning.job.succeeded"], description="ci")
    assert ep.secret.startswith("whsec_") and ep.events == ["fine_tuning.job.succeeded"]
    fetched = sdk.webhooks.retrieve(ep.id)
    assert fetched.secret is None and fetched.url == receiver.url  # the secret is shown once
    assert [e.id for e in sdk.webhooks.list()] == [ep.id]
    updated = sdk.webhooks.update(ep.id, events=[], enabled=False)
    assert updated.events == [] and updated.enabled is False
    rotated = sdk.webhooks.rotate_secret(ep.id, grace_period_s=60)
    assert rotated.secret.startswith("whsec_") and rotated.secret != ep.secret
    assert rotated.previous_secret_expires_at is not None

    other = tenant_key()
    with Tunefleet(base_url=service.base_url, api_key=other.key) as stranger:
        with pytest.raises(NotFoundError):
            stranger.webhooks.retrieve(ep.id)
        with pytest.raises(NotFoundError):
            stranger.webhooks.list_deliveries(ep.id)
        assert stranger.webhooks.list().data == []
    assert sdk.webhooks.delete(ep.id).deleted is True
    with pytest.raises(NotFoundError):
        sdk.webhooks.retrieve(ep.id)


def start_celery_worker(settings: Any, log: Path, extra_env: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {**settings_env(settings), **extra_env}
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker", "--pool", "solo",
         "--loglevel", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )


def test_job_events_are_signed_delivered_and_retried_by_celery(
    sdk: Tunefleet, service: Service, webhook_env: Any, receiver: Receiver, tmp_path: Path
) -> None:
    from control.queue import DELIVER_WEBHOOK, CeleryQueue
    from control.webhooks import events

    webhook_env(allow_private="true")
    # Fail the first two attempts of the `succeeded` event: the worker must retry it.
    def answer(received: list[Any]) -> int:
        last = json.loads(received[-1].body)
        tries = sum(json.loads(r.body)["id"] == last["id"] for r in received)
        return 500 if last["type"] == "fine_tuning.job.succeeded" and tries <= 2 else 204

    receiver.answer = answer
    endpoint = sdk.webhooks.create(url=receiver.url)
    queue = CeleryQueue(service.settings)
    events.set_dispatcher(lambda delivery_id: queue.send(DELIVER_WEBHOOK, delivery_id))
    worker = start_celery_worker(service.settings, tmp_path / "celery.log", {
        "TUNEFLEET_WEBHOOK_ALLOW_PRIVATE": "true", "TUNEFLEET_WEBHOOK_RETRY_BASE_S": "0.3"})
    try:
        fid = sdk.files.upload(chat_jsonl(), filename="t.jsonl", wait=True).id
        job = sdk.jobs.create(model=DEMO_MODEL, training_file=fid)
        driver = JobDriver(service, job.id)
        driver.start()
        driver.report({"type": "checkpoint", "step": 5, "location": driver.checkpoint_location(5), "metrics": {}})
        driver.finish("succeeded")
        got = receiver.wait_for(lambda rs: sum(b"succeeded" in r.body for r in rs) >= 3, timeout=60)
    finally:
        worker.terminate()
        worker.wait(timeout=20)
    log = (tmp_path / "celery.log").read_text()
    assert "Traceback" not in log, log

    webhook = Webhook(endpoint.secret)
    payloads = [webhook.verify(r.body, r.headers) for r in got]
    types = [p["type"] for p in payloads]
    assert types[:2] == ["fine_tuning.job.running", "fine_tuning.job.checkpoint.created"]
    assert types[2:] == ["fine_tuning.job.succeeded"] * 3
    assert all(p["object"] == "event" and p["data"]["id"] == job.id for p in payloads)
    assert payloads[1]["data"]["step_number"] == 5
    # Retries resend the same message: same id header, same signed body.
    succeeded = got[2:]
    assert len({r.headers["webhook-id"] for r in succeeded}) == 1 and len({r.body for r in succeeded}) == 1
    assert succeeded[0].headers["webhook-id"] == payloads[2]["id"]
    # Exponential backoff: 0.3 s, then 0.6 s (plus broker latency).
    gaps = [b.at - a.at for a, b in itertools.pairwise(succeeded)]
    assert gaps[0] >= 0.3 and gaps[1] >= 0.6, gaps

    # The official openai SDK accepts the same messages (its verifier and event types).
    from openai import OpenAI

    openai_client = OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")
    event = openai_client.webhooks.unwrap(got[2].body, got[2].headers, secret=endpoint.secret)
    assert event.type == "fine_tuning.job.succeeded" and event.data.id == job.id

    tampered = got[0].body.replace(b"running", b"succeeded")
    with pytest.raises(WebhookVerificationError):
        webhook.verify(tampered, got[0].headers)
    with pytest.raises(WebhookVerificationError):
        Webhook("whsec_" + "QUJD" * 8).verify(got[0].body, got[0].headers)

    log_rows = {d.event_type: d for d in sdk.webhooks.list_deliveries(endpoint.id)}
    final = log_rows["fine_tuning.job.succeeded"]
    assert final.status == "succeeded" and final.attempts == 3
    assert [a["status"] for a in final.attempt_log] == [500, 500, 204]
    assert log_rows["fine_tuning.job.running"].attempts == 1


def _deliveries(service: Service, endpoint_id: str) -> list[Any]:
    from control.db.session import session_scope
    from control.webhooks.models import WebhookDelivery

    with session_scope(service.settings.resolved_database_url) as session:
        rows = session.scalars(select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id)
                               .order_by(WebhookDelivery.created_at)).all()
        session.expunge_all()
        return list(rows)


def _attempt(service: Service, delivery_id: str, **overrides: Any) -> Any:
    from control.db.session import session_scope
    from control.webhooks.delivery import attempt_delivery

    updates = {"allow_private": True, "retry_base_s": 0.01, **overrides}
    settings = service.settings.model_copy(update={f"webhook_{k}": v for k, v in updates.items()})
    with session_scope(service.settings.resolved_database_url) as session:
        return attempt_delivery(session, delivery_id, settings, service_key=service.settings.secret_key_value())


def test_rotation_signs_with_both_secrets_during_the_grace_window(
    sdk: Tunefleet, service: Service, dispatched: list[str], receiver: Receiver
) -> None:
    old = sdk.webhooks.create(url=receiver.url, events=["fine_tuning.job.running"])
    new = sdk.webhooks.rotate_secret(old.id, grace_period_s=3600)
    driver = JobDriver(service, queued_job(service))
    driver.start()
    (delivery,) = _deliveries(service, old.id)
    assert dispatched == [delivery.id]  # sent to the queue only after the commit
    assert _attempt(service, delivery.id).status == "succeeded"
    (request,) = receiver.received
    assert len(request.headers["webhook-signature"].split(" ")) == 2
    assert Webhook(old.secret).verify(request.body, request.headers)["type"] == "fine_tuning.job.running"
    assert Webhook(new.secret).verify(request.body, request.headers)["type"] == "fine_tuning.job.running"

    newest = sdk.webhooks.rotate_secret(old.id, grace_period_s=0)
    sdk.webhooks.update(old.id, events=["fine_tuning.job.cancelled"])
    sdk.jobs.cancel(driver.job_id)
    cancelled = [d for d in _deliveries(service, old.id) if d.event_type == "fine_tuning.job.cancelled"]
    assert _attempt(service, cancelled[0].id).status == "succeeded"
    second = receiver.received[-1]
    assert len(second.headers["webhook-signature"].split(" ")) == 1
    assert Webhook(newest.secret).verify(second.body, second.headers)["type"] == "fine_tuning.job.cancelled"
    with pytest.raises(WebhookVerificationError):
        Webhook(new.secret).verify(second.body, second.headers)


@pytest.mark.usefixtures("dispatched")
def test_failures_back_off_then_give_up_and_filters_apply(sdk: Tunefleet, service: Service, receiver: Receiver) -> None:
    from control.observability.registry import WEBHOOK_FAILURES

    receiver.answer = lambda received: 503
    ep = sdk.webhooks.create(url=receiver.url, events=["fine_tuning.job.succeeded"])
    driver = JobDriver(service, queued_job(service))
    driver.start()
    assert _deliveries(service, ep.id) == []  # not subscribed to `running`
    driver.finish("succeeded")
    (delivery,) = _deliveries(service, ep.id)
    before = WEBHOOK_FAILURES._value.get()
    first = _attempt(service, delivery.id, max_attempts=3, retry_base_s=10)
    assert (first.status, first.retry_in_s) == ("pending", 10)
    assert _attempt(service, delivery.id, max_attempts=3).attempted is False  # not due yet: a duplicate task
    # Due again later: attempts 2 and 3, then it gives up.
    from control.db.session import session_scope
    from control.webhooks.models import WebhookDelivery

    for expected_delay, status in ((20, "pending"), (None, "failed")):
        with session_scope(service.settings.resolved_database_url) as session:
            session.get(WebhookDelivery, delivery.id).next_attempt_at = None
        outcome = _attempt(service, delivery.id, max_attempts=3, retry_base_s=10)
        assert (outcome.status, outcome.retry_in_s) == (status, expected_delay)
    assert len(receiver.received) == 3
    assert WEBHOOK_FAILURES._value.get() - before == 3
    (row,) = sdk.webhooks.list_deliveries(ep.id).data
    assert row.status == "failed" and row.attempts == 3 and row.response_status == 503


def test_target_rechecked_at_delivery_and_rollback_sends_nothing(
    sdk: Tunefleet, service: Service, dispatched: list[str], receiver: Receiver
) -> None:
    from control.db.session import session_factory
    from control.jobs.lifecycle import lock_job, transition

    ep = sdk.webhooks.create(url=receiver.url)
    driver = JobDriver(service, queued_job(service))

    session = session_factory(service.settings.resolved_database_url)()
    job = lock_job(session, driver.job_id)
    transition(session, job, "running", actor="scheduler")
    session.rollback()
    session.close()
    assert _deliveries(service, ep.id) == [] and dispatched == []

    driver.start()
    (delivery,) = _deliveries(service, ep.id)
    outcome = _attempt(service, delivery.id, allow_private=False)
    assert outcome.status == "pending" and receiver.received == []
    (row,) = _deliveries(service, ep.id)
    assert row.last_error.startswith("webhook_url_not_public")


@pytest.mark.usefixtures("dispatched")
def test_secrets_are_sealed_at_rest(sdk: Tunefleet, service: Service, receiver: Receiver) -> None:
    from control.db.session import session_scope
    from control.webhooks.models import WebhookEndpoint

    ep = sdk.webhooks.create(url=receiver.url, events=["fine_tuning.job.running"])
    with session_scope(service.settings.resolved_database_url) as session:
        stored = session.get(WebhookEndpoint, ep.id).secret
    assert ep.secret not in stored and ep.secret[6:] not in stored and stored.startswith("fernet1:")

    driver = JobDriver(service, queued_job(service))
    driver.start()
    (delivery,) = _deliveries(service, ep.id)
    from control.webhooks.delivery import attempt_delivery

    with session_scope(service.settings.resolved_database_url) as session:  # the service key changed
        outcome = attempt_delivery(session, delivery.id,
                                   service.settings.model_copy(update={"webhook_allow_private": True}),
                                   service_key="another-service-secret-key-0123456789")
    assert outcome.status == "pending" and receiver.received == []
    (row,) = _deliveries(service, ep.id)
    assert row.last_error.startswith("webhook_secret_unreadable")


def test_an_allowed_private_host_receives_webhooks_and_no_other_does(
    sdk: Tunefleet, service: Service, webhook_env: Any, receiver: Receiver
) -> None:
    """``TUNEFLEET_WEBHOOK_ALLOWED_HOSTS`` (an operator's in-cluster receiver) lets that
    private ``host:port`` be a target -- at creation and again at delivery -- while every
    other private target, the same host on another port included, stays refused."""
    from control.webhooks import events

    host_port = receiver.url.split("/")[2]
    webhook_env(allowed_hosts=host_port)
    with pytest.raises(BadRequestError) as other_port:
        sdk.webhooks.create(url=f"http://127.0.0.1:{int(host_port.rsplit(':', 1)[1]) + 1}/hook")
    assert other_port.value.code == "webhook_url_not_public"
    ep = sdk.webhooks.create(url=receiver.url, events=["fine_tuning.job.running"])
    dispatched: list[str] = []
    events.set_dispatcher(lambda delivery_id: dispatched.append(delivery_id) or True)
    JobDriver(service, queued_job(service)).start()
    (delivery,) = _deliveries(service, ep.id)
    assert _attempt(service, delivery.id, allow_private=False, allowed_hosts=host_port).status == "succeeded"
    (request,) = receiver.received
    assert Webhook(ep.secret).verify(request.body, request.headers)["type"] == "fine_tuning.job.running"
    # Taken off the list: the next delivery to it is refused at its target check.
    assert _attempt(service, delivery.id, allow_private=False, allowed_hosts=None).attempted is False
