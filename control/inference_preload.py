"""When a job succeeds, hint the embedded inference worker to load its base model now.

The first chat with a fine-tuned model right after its job succeeds would otherwise wait
for the base model to load (held up to ``TUNEFLEET_INFERENCE_LOAD_WAIT_S``). A transition
hook (``control.jobs.lifecycle``) sees ``-> succeeded`` and, once that transaction commits,
sends the worker ``POST /v1/preload`` with the base model's local path from a background
thread (``inference.client.InferenceClient.preload``): the worker starts the load only if
it is idle (no generation runs, nothing else loads), so a busy worker is never slowed by a
hint. Bases served by their own ``inference_url`` (vLLM) and non-local paths get none.
A hint that cannot be delivered is logged and dropped: the first request loads the model.

:func:`install` runs in every process that moves jobs to ``succeeded`` (the API, the Celery
worker, the scheduler); it is idempotent.
"""

from __future__ import annotations

import logging
import threading
from functools import partial

from sqlalchemy import event
from sqlalchemy.orm import Session

from control.db.models import Job, RegisteredModel
from control.models.base_models import load_base_models, registered_entry
from control.settings import Settings
from inference.client import InferenceClient, ModelRef

log = logging.getLogger(__name__)

_settings: list[Settings] = []  # the settings of the process that installed the hook


def install(settings: Settings) -> None:
    """Register the hook (once per process) with this process's ``settings``."""
    from control.jobs.lifecycle import register_transition_hook

    _settings[:] = [settings]
    register_transition_hook(on_transition)


def on_transition(session: Session, job: Job, from_status: str, to_status: str, actor: str) -> None:
    if to_status != "succeeded" or not _settings:
        return
    settings = _settings[0]
    base = local_base(session, settings, job.base_model)
    if base is not None:
        event.listen(session, "after_commit", partial(_after_commit, base, settings), once=True)


def local_base(session: Session, settings: Settings, model_id: str) -> ModelRef | None:
    """The embedded worker's reference to base model ``model_id``; None when it has none to
    load (unknown, served by an ``inference_url``, not a local directory)."""
    entry = load_base_models(settings).declared.get(model_id)
    if entry is None:
        row = session.get(RegisteredModel, model_id)
        entry = registered_entry(row) if row is not None and row.status == "ready" else None
    if entry is None or entry.inference_url is not None or "://" in entry.path or not entry.path:
        return None
    return ModelRef(id=entry.id, path=entry.path)


def _after_commit(base: ModelRef, settings: Settings, _session: Session) -> None:
    threading.Thread(target=send_hint, args=(base, settings), name="preload hint", daemon=True).start()


def send_hint(base: ModelRef, settings: Settings) -> str:
    """Ask the worker to load ``base``; its answer (``loading``, ``busy``, ``unreachable`` ...)."""
    answer = InferenceClient(settings.inference_url, settings.inference_secret_value()).preload(base)
    log.info("preload hint for %s: %s", base.id, answer)
    return answer
