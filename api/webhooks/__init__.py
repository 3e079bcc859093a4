"""Signed webhooks: per-tenant endpoints notified of job events (Standard Webhooks).

How it fits:
- ``routes.py``: CRUD under ``/v1/webhooks``, secret rotation, the delivery log.
The rules shared with the worker live in ``control.webhooks``:

- ``events.py``: a lifecycle transition hook (and a checkpoint insert listener) writes
  one outbox row per subscribed endpoint IN the transition's transaction; after the
  commit, each row is sent to Celery as ``tunefleet.deliver_webhook``.
- ``delivery.py``: one signed attempt; failures are rescheduled with exponential backoff.
- ``signing.py``: ``webhook-id`` / ``webhook-timestamp`` / ``webhook-signature`` headers
  (``v1,<base64 HMAC-SHA256>`` over ``id.timestamp.body``; ``whsec_`` secrets).
- ``urls.py``: target URL checks (no loopback/private/link-local addresses by default).
- ``models.py``: the ``webhook_endpoints`` and ``webhook_deliveries`` tables.

``control.webhooks.install_hooks()`` must run in every process that changes job status
(API, worker, scheduler); it is idempotent. ``install(app)`` does that for the API and
also adds the routes and sends deliveries through the app's task queue.
"""

from __future__ import annotations

from typing import Any


def install(app: Any) -> None:
    """Wire webhooks into the FastAPI ``app``: hooks, routes, and the app's task queue."""
    from api.webhooks.routes import router
    from control.webhooks import events, install_hooks

    install_hooks()
    queue = app.state.queue
    events.set_dispatcher(lambda delivery_id: queue.send(events.DELIVER_WEBHOOK, delivery_id))
    app.include_router(router)
