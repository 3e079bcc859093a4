"""Webhook deliveries through faults, in production mode (``tests.faults.production``).

The contract (``api/webhooks``): a delivery is retried with backoff until a 2xx answer;
it is at-least-once -- a receiver may see an event twice, always with the same
``webhook-id`` and signed body (``signing.py``: deduplicate on it) -- and never lost.

- The receiver refuses connections, then answers 500, then comes up: the event arrives,
  signed (verified with the ``standardwebhooks`` reference library), and is accepted once.
- The Celery worker is killed (-9) while the receiver holds its request: the worker that
  comes back delivers the event again, same id, same body.
- The event happens while the worker is dead (its delivery task waits in the queue): the
  worker that comes back delivers it exactly once, although both the queued task and its
  start-up sweep of overdue deliveries send it.

The event is a job's cancellation (``fine_tuning.job.cancelled``), the cheapest event a
real job makes.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook

from tests.conftest import free_port
from tests.faults import production
from tests.faults.production import ProductionStack, wait_until
from tests.integrations.webhook_receiver import Received, Receiver

EVENT = "fine_tuning.job.cancelled"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver(port=free_port())
    yield made
    made.stop()


def _endpoint(http: httpx.Client, receiver: Receiver) -> dict[str, Any]:
    created = http.post("/webhooks", json={"url": f"http://127.0.0.1:{receiver.port}/hooks", "events": [EVENT]})
    assert created.status_code == 200, created.text
    return created.json()


def _cancelled_job(http: httpx.Client) -> str:
    job_id = production.submit(http, production.upload_examples(http), n_epochs=1)
    cancelled = http.post(f"/fine_tuning/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    return job_id


def _delivery(http: httpx.Client, endpoint_id: str) -> dict[str, Any] | None:
    rows = http.get(f"/webhooks/{endpoint_id}/deliveries").json()["data"]
    return next((row for row in rows if row["event_type"] == EVENT), None)


def _assert_one_event_signed(received: list[Received], secret: str, job_id: str) -> None:
    """Every request is the same message (id, body), signed; the payload is the job's event."""
    assert len({r.headers["webhook-id"] for r in received}) == 1, [r.headers for r in received]
    assert len({r.body for r in received}) == 1
    for request in received:
        payload = Webhook(secret).verify(request.body, request.headers)
        assert (payload["type"], payload["data"]["id"]) == (EVENT, job_id)
        assert payload["id"] == request.headers["webhook-id"]


def test_a_receiver_that_refuses_then_fails_gets_the_event_once_after_retries(
    stack: ProductionStack, receiver: Receiver
) -> None:
    with stack.tenant_http("webhooks-down") as http:
        endpoint = _endpoint(http, receiver)
        job_id = _cancelled_job(http)
        # Refused at least twice (retries 0.5 s, then 1 s apart), before the receiver is up.
        wait_until(lambda: ((_delivery(http, endpoint["id"]) or {}).get("attempts") or 0) >= 2, 60,
                   "two refused attempts")
        receiver.answer = lambda received: 500 if len(received) == 1 else 204
        receiver.start()
        wait_until(lambda: (_delivery(http, endpoint["id"]) or {}).get("status") == "succeeded", 60,
                   f"the delivery\n{stack.service.dump_logs()}")
        delivery = _delivery(http, endpoint["id"])
    statuses = [a.get("status") for a in delivery["attempt_log"]]
    refused = statuses[:-2]
    assert len(refused) >= 2 and statuses[-2:] == [500, 204] and set(refused) == {None}, delivery
    assert all("ConnectError" in a["error"] for a in delivery["attempt_log"][:-2]), delivery
    assert delivery["attempts"] == len(statuses) and delivery["response_status"] == 204
    assert len(receiver.received) == 2  # the 500 and the one accepted
    _assert_one_event_signed(receiver.received, endpoint["secret"], job_id)


def test_a_worker_killed_mid_delivery_delivers_the_event_when_it_comes_back(
    stack: ProductionStack, receiver: Receiver
) -> None:
    arrived, release = threading.Event(), threading.Event()

    def hold_the_first(received: list[Received]) -> int:
        if len(received) == 1:
            arrived.set()
            release.wait(60)  # the worker dies waiting for this answer
        return 204

    receiver.answer = hold_the_first
    receiver.start()
    with stack.tenant_http("webhooks-kill") as http:
        endpoint = _endpoint(http, receiver)
        job_id = _cancelled_job(http)
        assert arrived.wait(60), f"no delivery attempt\n{stack.service.dump_logs()}"
        stack.service.stop("worker", sig=signal.SIGKILL)
        release.set()
        assert (_delivery(http, endpoint["id"]) or {}).get("status") == "pending"
        stack.service.start("worker")
        wait_until(lambda: (_delivery(http, endpoint["id"]) or {}).get("status") == "succeeded", 60,
                   f"the delivery after the worker came back\n{stack.service.dump_logs()}")
        delivery = _delivery(http, endpoint["id"])
    # The killed attempt's transaction died with the worker: the log holds the one that worked.
    assert delivery["attempts"] == 1 and delivery["response_status"] == 204, delivery
    assert len(receiver.received) == 2  # at-least-once: the held request, then the redelivery
    _assert_one_event_signed(receiver.received, endpoint["secret"], job_id)


def test_an_event_while_the_worker_is_dead_is_delivered_once_when_it_comes_back(
    stack: ProductionStack, receiver: Receiver
) -> None:
    from worker.tasks.webhooks import RESEND_AFTER_START_S

    receiver.start()
    with stack.tenant_http("webhooks-dead") as http:
        endpoint = _endpoint(http, receiver)
        file_id = production.upload_examples(http)  # validated by the worker while it lives
        stack.service.stop("worker", sig=signal.SIGKILL)
        job_id = production.submit(http, file_id, n_epochs=1)
        assert http.post(f"/fine_tuning/jobs/{job_id}/cancel").status_code == 200
        assert (_delivery(http, endpoint["id"]) or {}).get("status") == "pending"
        stack.service.start("worker")
        stack.wait_ready()
        swept = time.monotonic() + RESEND_AFTER_START_S + 5  # the start-up sweep has run by then
        wait_until(lambda: (_delivery(http, endpoint["id"]) or {}).get("status") == "succeeded", 60,
                   f"the delivery after the worker came back\n{stack.service.dump_logs()}")
        production.sleep_until(swept)
        delivery = _delivery(http, endpoint["id"])
    assert delivery["attempts"] == 1 and delivery["response_status"] == 204, delivery
    assert len(receiver.received) == 1, [r.headers for r in receiver.received]
    _assert_one_event_signed(receiver.received, endpoint["secret"], job_id)
