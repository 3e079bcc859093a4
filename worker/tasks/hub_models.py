"""Celery task ``tunefleet.fetch_hub_model``: download a registered Hub model and check it.

``POST /v1/models`` with a Hub source stores the registration as ``fetching`` and sends
this task; control/models/registry.py does the work (download once per commit, the checkpoint
checks) and marks the registration ready or failed with the error's code.
"""

from __future__ import annotations

from control.db.session import session_scope
from control.models.registry import fetch_registered_model
from control.settings import get_settings
from worker.celery_app import app


@app.task(name="tunefleet.fetch_hub_model", acks_late=True)
def fetch_hub_model_task(model_id: str) -> str:
    settings = get_settings()
    with session_scope(settings.resolved_database_url) as session:
        return fetch_registered_model(session, settings, model_id)
