"""From job changes to outbox rows, and from committed rows to Celery tasks.

Event types (OpenAI's names, plus two of ours)::

    fine_tuning.job.running      a job started (or restarted) training
    fine_tuning.job.succeeded    the adapter is ready
    fine_tuning.job.failed
    fine_tuning.job.cancelled
    fine_tuning.job.checkpoint.created

Payload (OpenAI's webhook event shape)::

    {"id": "evt_...", "object": "event", "type": "fine_tuning.job.succeeded",
     "created_at": 1764423123, "data": {"id": "ftjob-..."}}

``on_transition`` is registered with ``control.jobs.lifecycle.register_transition_hook`` and runs
inside the transition's transaction; the checkpoint listener runs inside the flush that
inserts a ``Checkpoint``. Both only write rows. Sending happens after COMMIT (a task for
a rolled-back row would find nothing), from ``session.info`` via an ``after_commit``
listener; ``sweep_due_deliveries`` re-sends anything a crash left behind.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, event, insert, select
from sqlalchemy.orm import Mapper, Session, object_session

from control.db.base import utcnow
from control.db.models import Checkpoint, Job
from control.ids import new_id
from control.webhooks.models import WebhookDelivery, WebhookEndpoint

log = logging.getLogger(__name__)

EVENT_TYPES = (
    "fine_tuning.job.running",
    "fine_tuning.job.succeeded",
    "fine_tuning.job.failed",
    "fine_tuning.job.cancelled",
    "fine_tuning.job.checkpoint.created",
)
_STATUS_EVENTS = {
    "running": "fine_tuning.job.running",
    "succeeded": "fine_tuning.job.succeeded",
    "failed": "fine_tuning.job.failed",
    "cancelled": "fine_tuning.job.cancelled",
}
_PENDING_KEY = "tunefleet.webhook_deliveries"
_ENDPOINTS_KEY = "tunefleet.webhook_endpoints"  # session.info: tenant -> endpoints, this transaction
DELIVER_WEBHOOK = "tunefleet.deliver_webhook"

# Where committed deliveries are sent: a callable(delivery_id) -> bool. Defaults to the
# Celery queue of the process settings; tests and the API may install their own.
_dispatch: Callable[[str], bool] | None = None


def set_dispatcher(dispatch: Callable[[str], bool] | None) -> None:
    global _dispatch
    _dispatch = dispatch


def _default_dispatch(delivery_id: str) -> bool:
    global _dispatch
    if _dispatch is None:
        from control.queue import CeleryQueue
        from control.settings import get_settings

        queue = CeleryQueue(get_settings())
        _dispatch = lambda delivery: queue.send(DELIVER_WEBHOOK, delivery)
    return _dispatch(delivery_id)


def event_body(event_id: str, event_type: str, created_at: dt.datetime, data: dict[str, Any]) -> str:
    """The exact JSON text that is signed and sent."""
    payload = {"id": event_id, "object": "event", "type": event_type,
               "created_at": int(created_at.timestamp()), "data": data}
    return json.dumps(payload, separators=(",", ":"))


def subscribed(endpoint_events: list[Any], event_type: str) -> bool:
    return not endpoint_events or event_type in endpoint_events


def _endpoints_query(tenant_id: str) -> Any:
    """(id, events) of the tenant's live endpoints."""
    return select(WebhookEndpoint.id, WebhookEndpoint.events).where(
        WebhookEndpoint.tenant_id == tenant_id,
        WebhookEndpoint.enabled.is_(True),
        WebhookEndpoint.deleted_at.is_(None),
    )


def _delivery_rows(endpoints: list[Any], event_type: str, job_id: str,
                   data: dict[str, Any], tenant_id: str) -> list[dict[str, Any]]:
    now = utcnow()
    event_id = new_id("evt")
    body = event_body(event_id, event_type, now, data)
    return [
        {"id": new_id("whdel"), "endpoint_id": endpoint_id, "tenant_id": tenant_id, "event_id": event_id,
             "event_type": event_type, "job_id": job_id, "body": body, "status": "pending", "attempts": 0,
             "next_attempt_at": now, "attempt_log": [], "created_at": now}
        for endpoint_id, events in endpoints if subscribed(events or [], event_type)
    ]


def _remember(session: Session, delivery_ids: list[str]) -> None:
    session.info.setdefault(_PENDING_KEY, []).extend(delivery_ids)


def on_transition(session: Session, job: Job, from_status: str, to_status: str, actor: str) -> None:
    """Lifecycle hook: outbox rows for every endpoint subscribed to this status event."""
    event_type = _STATUS_EVENTS.get(to_status)
    if event_type is None:
        return
    # Read once per tenant and transaction: the scheduler moves hundreds of jobs in one.
    known = session.info.setdefault(_ENDPOINTS_KEY, {})
    if job.tenant_id not in known:
        known[job.tenant_id] = list(session.execute(_endpoints_query(job.tenant_id)))
    rows = _delivery_rows(known[job.tenant_id], event_type, job.id, {"id": job.id}, job.tenant_id)
    for row in rows:
        session.add(WebhookDelivery(**row))
    _remember(session, [row["id"] for row in rows])


def _on_checkpoint_insert(_mapper: Mapper[Any], connection: Connection, checkpoint: Checkpoint) -> None:
    """Mapper listener: a registered checkpoint is a ``checkpoint.created`` event.

    Runs inside the flush, so it writes with ``connection`` (same transaction)."""
    tenant_id = connection.scalar(select(Job.tenant_id).where(Job.id == checkpoint.job_id))
    if tenant_id is None:
        return
    endpoints = list(connection.execute(_endpoints_query(tenant_id)))
    data = {"id": checkpoint.job_id, "checkpoint_id": checkpoint.id, "step_number": checkpoint.step}
    rows = _delivery_rows(endpoints, "fine_tuning.job.checkpoint.created", checkpoint.job_id, data, tenant_id)
    if rows:
        connection.execute(insert(WebhookDelivery), rows)
        session = object_session(checkpoint)
        if session is not None:
            _remember(session, [row["id"] for row in rows])


def _after_commit(session: Session) -> None:
    session.info.pop(_ENDPOINTS_KEY, None)
    delivery_ids = session.info.pop(_PENDING_KEY, None)
    for delivery_id in delivery_ids or []:
        try:
            sent = _default_dispatch(delivery_id)
        except Exception:  # the commit already happened: never fail the caller for this
            log.exception("webhook delivery %s: enqueueing failed", delivery_id)
            sent = False
        if not sent:
            log.warning("webhook delivery %s not enqueued; the sweep will send it", delivery_id)


def _after_rollback(session: Session) -> None:
    session.info.pop(_PENDING_KEY, None)
    session.info.pop(_ENDPOINTS_KEY, None)


_installed = False


def install() -> None:
    """Register the hook and listeners once per process."""
    global _installed
    if _installed:
        return
    from control.jobs.lifecycle import register_transition_hook

    register_transition_hook(on_transition)
    event.listen(Checkpoint, "after_insert", _on_checkpoint_insert)
    event.listen(Session, "after_commit", _after_commit)
    event.listen(Session, "after_rollback", _after_rollback)
    _installed = True


def sweep_due_deliveries(session: Session, now: dt.datetime | None = None,
                         stale_after: dt.timedelta = dt.timedelta(minutes=5)) -> list[str]:
    """Re-send pending deliveries overdue by ``stale_after`` (lost task or crash before send)."""
    now = now or utcnow()
    rows = session.scalars(
        select(WebhookDelivery.id).where(
            WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now - stale_after
        ).limit(500)
    )
    ids = list(rows)
    for delivery_id in ids:
        _default_dispatch(delivery_id)
    return ids
