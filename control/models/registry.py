"""Base models admins register through ``POST /v1/models``, next to the YAML registry.

A registration names a source: an absolute local directory, an ``s3://`` prefix, or a
Hugging Face Hub id ``org/name[@revision]`` (control/models/hub.py). A directory or S3 checkpoint
is checked at once (control/models/checkpoint_checks.py), so a broken one is a 400 and never
registered. A Hub id must be allowed by the operator; the row is then ``fetching`` while
the worker's ``tunefleet.fetch_hub_model`` downloads the commit the revision names,
checks it the same way, and turns it ``ready`` (with the commit sha) or ``failed`` (with
the error's code: ``model_not_found``, ``model_access_denied``, ``hub_unreachable``, or
a checkpoint check's). Only ready registrations are in the registry jobs train on
(control/models/base_models.py).

YAML entries stay the declarative option: their ids cannot be registered again nor
deleted through the API.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from control.artifacts import artifact_store, store_for
from control.db.models import TERMINAL_STATUSES, Job, RegisteredModel
from control.errors import APIError, not_found
from control.models.base_models import BaseModelRegistry
from control.models.checkpoint_checks import CheckpointInfo, check_checkpoint, checkpoint_error
from control.models.hub import HubError, check_allowed, fetch_snapshot, parse_hub_id
from control.queue import TaskQueue
from control.settings import Settings

log = logging.getLogger(__name__)

FETCH_HUB_MODEL = "tunefleet.fetch_hub_model"


def register_model(session: Session, settings: Settings, registry: BaseModelRegistry, *, source: str,
                   model_id: str | None, hf_id: str | None, admin_tenant_id: str, queue: TaskQueue) -> RegisteredModel:
    """Check and store a registration of ``source`` (an absolute directory, an s3:// prefix
    or a Hub id) as ``model_id`` (the Hub id's name when None); a Hub source is queued for
    the worker to fetch."""
    ref = parse_hub_id(source)
    if ref is None and not (source.startswith(("/", "s3://"))):
        raise APIError(400, "invalid_model_source",
                       f"source '{source}' is neither an absolute directory, an s3:// prefix "
                       "nor a Hub id org/name[@revision].", param="source")
    model_id = model_id or (ref.repo_id if ref is not None else None)
    if model_id is None:
        raise APIError(400, "invalid_request", "id is required unless source is a Hub id.", param="id")
    if model_id in registry.declared or session.get(RegisteredModel, model_id) is not None:
        raise APIError(409, "model_exists", f"A base model '{model_id}' exists already.", param="id")
    row = RegisteredModel(id=model_id, source=source, created_by=admin_tenant_id, hf_id=hf_id)
    if ref is not None:
        try:
            check_allowed(ref, settings)
        except HubError as exc:
            raise APIError(400, exc.code, exc.message, param="source") from exc
        row.status, row.revision = "fetching", ref.revision
        row.hf_id = hf_id or ref.repo_id
    else:
        location = _allowed_location(source, settings)
        _mark_ready(row, location, _check_source(location, settings))
    session.add(row)
    session.commit()
    if ref is not None:
        queue.send(FETCH_HUB_MODEL, row.id)
    return row


def delete_registered_model(session: Session, registry: BaseModelRegistry, model_id: str) -> None:
    """Remove a registration (admins): 409 for a YAML id or a model live jobs train on.

    The checkpoint's files stay where they are (a local directory or S3 prefix belongs to
    the operator; a Hub download is kept for a registration of the same commit)."""
    if model_id in registry.declared:
        raise APIError(409, "model_declared_in_file",
                       f"'{model_id}' is declared in TUNEFLEET_BASE_MODELS_FILE; remove it there.",
                       param="model")
    row = session.get(RegisteredModel, model_id)
    if row is None:
        raise not_found("model", model_id)
    live = session.scalar(select(Job.id).where(Job.base_model == model_id,
                                               Job.status.not_in(TERMINAL_STATUSES)).limit(1))
    if live is not None:
        raise APIError(409, "model_in_use", f"Job {live} still trains on '{model_id}'; cancel it or "
                       "wait until it ends.", param="model")
    session.delete(row)
    session.commit()


def fetch_registered_model(session: Session, settings: Settings, model_id: str) -> str:
    """The worker's half of a Hub registration: fetch, check, mark ready or failed.

    Returns the row's new status (``ready``/``failed``), or ``gone`` when it was deleted.
    """
    row = session.get(RegisteredModel, model_id)
    if row is None or row.status != "fetching":
        return "gone" if row is None else row.status
    ref = parse_hub_id(row.source)
    try:
        if ref is None:
            raise HubError("invalid_model_source", f"source '{row.source}' is not a Hub id.")
        snapshot = fetch_snapshot(ref, settings, artifact_store(settings))
        info = check_checkpoint(store_for(snapshot.location, s3_endpoint_url=settings.s3_endpoint_url))
    except HubError as exc:
        row.status, row.error = "failed", {"code": exc.code, "message": exc.message}
    except APIError as exc:  # a checkpoint check
        row.status, row.error = "failed", {"code": exc.code, "message": exc.message}
    else:
        _mark_ready(row, snapshot.location, info)
        row.commit_sha = snapshot.commit_sha
    if row.status == "failed":
        log.warning("Hub model %s (%s) failed: %s", model_id, row.source, row.error)
    session.commit()
    return row.status


def _allowed_location(source: str, settings: Settings) -> str:
    """``source`` itself for an s3:// prefix; for a directory, its real path, which must lie
    under one of ``settings.model_root_dirs`` (a link or ``..`` cannot lead out of them).
    The real path is what is checked and trained on, so a link changed later does not
    redirect the registration."""
    if source.startswith("s3://"):
        return source
    real = Path(source).resolve()
    if not any(real.is_relative_to(root) for root in settings.model_root_dirs):
        raise APIError(400, "model_source_not_allowed",
                       f"'{source}' is not under a directory models may be registered from "
                       "(TUNEFLEET_MODEL_ROOTS).", param="source")
    return str(real)


def _check_source(source: str, settings: Settings) -> CheckpointInfo:
    try:
        files = store_for(source, s3_endpoint_url=settings.s3_endpoint_url)
        return check_checkpoint(files)
    except APIError:
        raise
    except Exception as exc:  # an S3 store that cannot be read (credentials, bucket)
        log.warning("cannot read model source %s", source, exc_info=True)
        raise checkpoint_error("model_source_unreadable", f"Cannot read {source}: {exc}.") from exc


def _mark_ready(row: RegisteredModel, path: str, info: CheckpointInfo) -> None:
    row.status, row.path, row.error = "ready", path, None
    row.architecture, row.max_seq_len, row.params_b = info.architecture, info.max_seq_len, info.params_b
