"""Celery tasks of the webhooks feature.

``tunefleet.deliver_webhook(delivery_id)``: one signed attempt (``control.webhooks.delivery``);
on failure the next attempt is a new task message with a countdown (exponential
backoff), so a worker restart loses nothing: the row stays ``pending`` with its
``next_attempt_at`` and ``tunefleet.sweep_webhooks`` re-sends overdue rows -- within
seconds for the rows that were due when a worker started (one killed mid-delivery
comes back).

Importing this module (Celery does, via ``worker.celery_app.TASK_MODULES``) also installs
the webhook transition hook in the worker process, where the scheduler and executors
change job statuses.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

from celery.signals import worker_ready

from control.db.session import session_scope
from control.settings import get_settings
from control.webhooks import install_hooks
from control.webhooks.delivery import attempt_delivery
from control.webhooks.events import sweep_due_deliveries
from worker.celery_app import app

log = logging.getLogger(__name__)

install_hooks()


@app.task(name="tunefleet.deliver_webhook", acks_late=True, reject_on_worker_lost=True)
def deliver_webhook(delivery_id: str) -> str:
    """Attempt ``delivery_id`` once; schedule the retry when it failed and attempts remain."""
    settings = get_settings()
    with session_scope(settings.resolved_database_url) as session:
        outcome = attempt_delivery(session, delivery_id, settings,
                                   service_key=settings.secret_key_value())
    if outcome.retry_in_s is not None:
        deliver_webhook.apply_async((delivery_id,), countdown=outcome.retry_in_s)
    log.info("webhook delivery %s: %s (HTTP %s)", delivery_id, outcome.status, outcome.response_status)
    return outcome.status


@app.task(name="tunefleet.sweep_webhooks", acks_late=True, reject_on_worker_lost=True)
def sweep_webhooks(due_before: float | None = None) -> int:
    """Re-send pending deliveries whose task was lost (crash between commit and send):
    those minutes overdue, or (``due_before``, seconds since the epoch) all due by then."""
    settings = get_settings()
    with session_scope(settings.resolved_database_url) as session:
        if due_before is None:
            return len(sweep_due_deliveries(session))
        cutoff = dt.datetime.fromtimestamp(due_before, dt.UTC)
        return len(sweep_due_deliveries(session, now=cutoff, stale_after=dt.timedelta(0)))


# How long after its start a worker looks for deliveries lost by the worker before it:
# long enough to have run the tasks still queued for them (those moved their rows on).
RESEND_AFTER_START_S = 5.0


@worker_ready.connect
def resend_lost_deliveries(**_: Any) -> None:
    """A starting worker re-sends the deliveries that were due before it started and are
    still pending shortly after.

    A worker killed mid-delivery (``kill -9``, the OOM killer) takes its task along: Redis
    gives an unacknowledged message back only after the visibility timeout (a day), and the
    periodic sweep waits until a delivery is minutes overdue. The worker that comes back
    need not wait. A delivery whose task was only queued has been attempted by then (its
    row is no longer due before the cutoff); should one still be sent twice, an attempt
    changes nothing for a delivery that is no longer pending or not yet due.
    """
    sweep_webhooks.apply_async(kwargs={"due_before": time.time()}, countdown=RESEND_AFTER_START_S)
