"""Celery tasks of the webhooks feature.

``tunefleet.deliver_webhook(delivery_id)``: one signed attempt (``api.webhooks.delivery``);
on failure the next attempt is a new task message with a countdown (exponential
backoff), so a worker restart loses nothing: the row stays ``pending`` with its
``next_attempt_at`` and ``tunefleet.sweep_webhooks`` re-sends overdue rows.

Importing this module (Celery does, via ``worker.celery_app.TASK_MODULES``) also installs
the webhook transition hook in the worker process, where the scheduler and executors
change job statuses.
"""

from __future__ import annotations

import logging

from api.db.session import session_scope
from api.settings import get_settings
from api.webhooks import install_hooks
from api.webhooks.config import get_webhook_settings
from api.webhooks.delivery import attempt_delivery
from api.webhooks.events import sweep_due_deliveries
from worker.celery_app import app

log = logging.getLogger(__name__)

install_hooks()


@app.task(name="tunefleet.deliver_webhook", acks_late=True, reject_on_worker_lost=True)
def deliver_webhook(delivery_id: str) -> str:
    """Attempt ``delivery_id`` once; schedule the retry when it failed and attempts remain."""
    settings = get_settings()
    with session_scope(settings.resolved_database_url) as session:
        outcome = attempt_delivery(session, delivery_id, get_webhook_settings(),
                                   service_key=settings.secret_key_value())
    if outcome.retry_in_s is not None:
        deliver_webhook.apply_async((delivery_id,), countdown=outcome.retry_in_s)
    log.info("webhook delivery %s: %s (HTTP %s)", delivery_id, outcome.status, outcome.response_status)
    return outcome.status


@app.task(name="tunefleet.sweep_webhooks", acks_late=True, reject_on_worker_lost=True)
def sweep_webhooks() -> int:
    """Re-send pending deliveries whose task was lost (crash between commit and send)."""
    settings = get_settings()
    with session_scope(settings.resolved_database_url) as session:
        return len(sweep_due_deliveries(session))
