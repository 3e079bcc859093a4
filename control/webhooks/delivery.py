"""One delivery attempt: sign, POST, record, and decide when to try again.

``attempt_delivery`` is called by the Celery task ``tunefleet.deliver_webhook``. It is
idempotent: a delivery that is no longer pending, or not yet due (a duplicate task
message), is left alone. A 2xx answer ends the delivery; anything else (non-2xx,
timeout, refused connection, a target that now resolves to an internal address) counts
as a failed attempt, retried after ``retry_base_s * 2**(attempt-1)`` seconds (capped at
``retry_max_s``) until ``max_attempts``. Redirects are not followed: a receiver must
answer at the URL it registered. The connection goes to the address the target check
approved (``urls.pinned_request``), not to a fresh DNS answer.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session

from control.db.base import utcnow
from control.settings import Settings
from control.webhooks.models import WebhookDelivery, WebhookEndpoint
from control.webhooks.sealing import SecretUnreadable
from control.webhooks.signing import signature_headers
from control.webhooks.urls import TargetURLError, checked_target, pinned_request

log = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 500
_USER_AGENT = "tunefleet-webhooks/1"


@dataclass(frozen=True)
class AttemptOutcome:
    """What happened; ``retry_in_s`` is set when another attempt is scheduled."""

    delivery_id: str
    status: str
    attempted: bool
    response_status: int | None = None
    retry_in_s: float | None = None


def retry_delay_s(attempts_so_far: int, settings: Settings) -> float:
    """Delay after the ``attempts_so_far``-th failed attempt (1-based): exponential, capped."""
    return min(settings.webhook_retry_base_s * (2 ** (attempts_so_far - 1)), settings.webhook_retry_max_s)


def attempt_delivery(
    session: Session,
    delivery_id: str,
    settings: Settings,
    *,
    service_key: str,
    http: httpx.Client | None = None,
    now: dt.datetime | None = None,
) -> AttemptOutcome:
    """Make one attempt for ``delivery_id`` and record it; the caller commits.

    Args:
        service_key: the service secret key that seals the endpoint's signing secrets."""
    delivery = session.scalar(select(WebhookDelivery).where(WebhookDelivery.id == delivery_id).with_for_update())
    if delivery is None:
        return AttemptOutcome(delivery_id, "missing", attempted=False)
    now = now or utcnow()
    if delivery.status != "pending":
        return AttemptOutcome(delivery_id, delivery.status, attempted=False)
    if delivery.next_attempt_at is not None and delivery.next_attempt_at > now + dt.timedelta(seconds=1):
        return AttemptOutcome(delivery_id, "pending", attempted=False)
    endpoint = session.get(WebhookEndpoint, delivery.endpoint_id)
    if endpoint is None or endpoint.deleted_at is not None or not endpoint.enabled:
        delivery.status = "failed"
        delivery.last_error = "endpoint deleted or disabled"
        delivery.next_attempt_at = None
        return AttemptOutcome(delivery_id, "failed", attempted=False)

    response_status, error, started = None, None, time.monotonic()
    try:
        url, pinned_headers, extensions = pinned_request(
            checked_target(endpoint.url, allow_private=settings.webhook_allow_private,
                           allowed_hosts=settings.webhook_allowed_hosts))
        timestamp = int(now.timestamp())
        headers = signature_headers(endpoint.signing_secrets(now, service_key), delivery.event_id, timestamp,
                                    delivery.body)
        headers.update({"content-type": "application/json", "user-agent": _USER_AGENT, **pinned_headers})
        client = http or httpx.Client(timeout=settings.webhook_timeout_s, follow_redirects=False)
        try:
            response = client.post(url, content=delivery.body.encode("utf-8"), headers=headers,
                                   extensions=extensions)
        finally:
            if http is None:
                client.close()
        response_status = response.status_code
        if not response.is_success:
            error = f"HTTP {response.status_code}: {response.text[:_MAX_ERROR_CHARS]}"
    except TargetURLError as exc:
        error = f"{exc.code}: {exc.message}"
    except SecretUnreadable as exc:
        error = f"webhook_secret_unreadable: {exc}; rotate the endpoint's secret"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]

    delivery.attempts += 1
    delivery.last_attempt_at = now
    delivery.response_status = response_status
    delivery.last_error = error
    delivery.attempt_log = [*(delivery.attempt_log or []), {
        "at": int(now.timestamp()), "status": response_status, "error": error,
        "duration_ms": round((time.monotonic() - started) * 1000, 1),
    }]
    if error is None:
        delivery.status = "succeeded"
        delivery.delivered_at = now
        delivery.next_attempt_at = None
        return AttemptOutcome(delivery_id, "succeeded", attempted=True, response_status=response_status)

    _count_failure(endpoint.id)
    if delivery.attempts >= settings.webhook_max_attempts:
        delivery.status = "failed"
        delivery.next_attempt_at = None
        log.warning("webhook %s to %s failed for good after %d attempts: %s",
                    delivery.id, endpoint.url, delivery.attempts, error)
        return AttemptOutcome(delivery_id, "failed", attempted=True, response_status=response_status)
    delay = retry_delay_s(delivery.attempts, settings)
    delivery.next_attempt_at = now + dt.timedelta(seconds=delay)
    return AttemptOutcome(delivery_id, "pending", attempted=True, response_status=response_status, retry_in_s=delay)


def _count_failure(endpoint_id: str) -> None:
    try:
        from control.observability.registry import WEBHOOK_FAILURES
    except ImportError:  # observability is optional in trimmed images
        return
    WEBHOOK_FAILURES.inc()
