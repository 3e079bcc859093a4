"""``/v1/models``: base models of the registry (the YAML file's and those admins register
here), the tenant's fine-tuned adapters (which the tenant may delete) and the adapters other
tenants share with it (``api.checkpoint_permissions``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from sqlalchemy import select

from api.checkpoint_permissions.queries import shared_with
from api.deps import (
    AdminDep,
    BaseModelsDep,
    CurrentKey,
    QueueDep,
    SessionDep,
    SettingsDep,
    StartedAtDep,
)
from api.errors import error_responses
from api.models.fine_tuned import delete_fine_tuned_model, tenant_adapters
from api.models.schemas import ModelCreate, ModelDeleted, ModelPublic, ModelsPublic
from control.db.base import to_unix
from control.db.models import CheckpointPermission, Job, RegisteredModel
from control.errors import APIError, not_found
from control.models.base_models import BaseModelEntry
from control.models.registry import delete_registered_model, register_model

router = APIRouter(prefix="/v1/models", tags=["models"])


def _base(entry: BaseModelEntry, started: int) -> dict[str, Any]:
    return {"id": entry.id, "object": "model", "created": started, "owned_by": entry.owned_by,
            "kind": "base", "architecture": entry.architecture, "max_seq_len": entry.max_seq_len,
            "revision": entry.revision}


def _registered(row: RegisteredModel, *, admin: bool) -> dict[str, Any]:
    """A registration; where its files are (``source``, and an ``error`` that may quote it)
    is the operator's business, shown to admins only."""
    model = {"id": row.id, "object": "model", "created": to_unix(row.created_at), "owned_by": "tunefleet",
             "kind": "base", "architecture": row.architecture, "max_seq_len": row.max_seq_len,
             "status": row.status, "revision": row.commit_sha}
    if admin:
        model.update(source=row.source, error=row.error)
    return model


def _adapter(job: Job) -> dict[str, Any]:
    """A fine-tuned model: ``parent`` is the model its job started from (a base model, or the
    fine-tuned model or checkpoint it continued), ``root`` the base model the adapter applies to."""
    return {"id": job.fine_tuned_model, "object": "model",
            "created": to_unix(job.finished_at or job.created_at), "owned_by": job.tenant_id,
            "kind": "adapter", "parent": job.model, "root": job.base_model, "fine_tuning_job": job.id}


def _shared(permission: CheckpointPermission, job: Job) -> dict[str, Any]:
    return {**_adapter(job), "id": permission.model, "created": to_unix(permission.created_at)}


@router.get("", response_model=ModelsPublic)
def list_models(
    session: SessionDep, key: CurrentKey, registry: BaseModelsDep, started_at: StartedAtDep
) -> dict[str, Any]:
    """The declared base models, the registered ones ready to train on, the tenant's adapters."""
    data = [_base(e, started_at) for e in registry.declared.values()]
    ready = select(RegisteredModel).where(RegisteredModel.status == "ready").order_by(RegisteredModel.created_at)
    data += [_registered(r, admin=key.grants_admin) for r in session.scalars(ready) if r.id not in registry.declared]
    data += [_adapter(j) for j in session.scalars(tenant_adapters(key.tenant_id).order_by(Job.created_at))]
    data += [_shared(p, j) for p, j in shared_with(session, key.tenant_id)]
    return {"object": "list", "data": data}


@router.post("", response_model=ModelPublic, responses=error_responses(400, 403, 409))
def create_model(body: ModelCreate, session: SessionDep, key: AdminDep, settings: SettingsDep,
                 queue: QueueDep, registry: BaseModelsDep) -> dict[str, Any]:
    """Register a base model (admins). A directory or s3:// checkpoint is checked now and
    answered ``ready``; a Hub id is answered ``fetching`` until the worker has it."""
    row = register_model(session, settings, registry, source=body.source, model_id=body.id, hf_id=body.hf_id,
                         admin_tenant_id=key.tenant_id, queue=queue)
    return _registered(row, admin=True)


@router.get("/{model_id:path}", response_model=ModelPublic, responses=error_responses(404))
def retrieve_model(
    model_id: str, session: SessionDep, key: CurrentKey, registry: BaseModelsDep,
    started_at: StartedAtDep,
) -> dict[str, Any]:
    entry = registry.declared.get(model_id)
    if entry is not None:
        return _base(entry, started_at)
    row = session.get(RegisteredModel, model_id)
    if row is not None:
        return _registered(row, admin=key.grants_admin)
    job = session.scalar(tenant_adapters(key.tenant_id).where(Job.fine_tuned_model == model_id))
    if job is not None:
        return _adapter(job)
    shared = next(((p, j) for p, j in shared_with(session, key.tenant_id) if p.model == model_id), None)
    if shared is None:
        raise not_found("model", model_id)
    return _shared(*shared)


@router.delete("/{model_id:path}", response_model=ModelDeleted, responses=error_responses(403, 404, 409))
def delete_model(
    model_id: str, session: SessionDep, key: CurrentKey, settings: SettingsDep,
    registry: BaseModelsDep,
) -> ModelDeleted:
    """Delete a fine-tuned model (its adapter and the job's other outputs), or, with an
    admin key, a registered base model. Other base models cannot be deleted: 403 for a
    tenant, 409 for a model of the YAML file; a model whose job has not ended is a 409."""
    is_base = model_id in registry.declared or session.get(RegisteredModel, model_id) is not None
    if is_base and key.grants_admin:
        delete_registered_model(session, registry, model_id)
    elif is_base:
        raise APIError(403, "base_model_not_deletable",
                       f"'{model_id}' is a base model; only fine-tuned models can be deleted "
                       "(registered base models: by an admin).", param="model")
    else:
        delete_fine_tuned_model(session, key.tenant, model_id, settings=settings)
    return ModelDeleted(id=model_id)
