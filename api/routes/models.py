"""``/v1/models``: base models of the registry and the tenant's fine-tuned adapters (which
the tenant may delete)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from api.base_models import BaseModelEntry
from api.db.base import to_unix
from api.db.models import Job
from api.deps import CurrentTenant, SessionDep, SettingsDep
from api.errors import APIError, error_responses, not_found
from api.fine_tuned_models import delete_fine_tuned_model, tenant_adapters
from api.schemas.models import ModelDeleted, ModelPublic, ModelsPublic

router = APIRouter(prefix="/v1/models", tags=["models"])


def _base(entry: BaseModelEntry, started: int) -> dict[str, Any]:
    return {"id": entry.id, "object": "model", "created": started, "owned_by": entry.owned_by,
            "kind": "base", "architecture": entry.architecture, "max_seq_len": entry.max_seq_len}


def _adapter(job: Job) -> dict[str, Any]:
    return {"id": job.fine_tuned_model, "object": "model",
            "created": to_unix(job.finished_at or job.created_at), "owned_by": job.tenant_id,
            "kind": "adapter", "parent": job.model, "fine_tuning_job": job.id}


@router.get("", response_model=ModelsPublic)
def list_models(request: Request, session: SessionDep, tenant: CurrentTenant) -> dict[str, Any]:
    started = request.app.state.started_at
    data = [_base(e, started) for e in request.app.state.base_models.values()]
    data += [_adapter(j) for j in session.scalars(tenant_adapters(tenant.id).order_by(Job.created_at))]
    return {"object": "list", "data": data}


@router.get("/{model_id:path}", response_model=ModelPublic, responses=error_responses(404))
def retrieve_model(
    model_id: str, request: Request, session: SessionDep, tenant: CurrentTenant
) -> dict[str, Any]:
    entry = request.app.state.base_models.get(model_id)
    if entry is not None:
        return _base(entry, request.app.state.started_at)
    job = session.scalar(tenant_adapters(tenant.id).where(Job.fine_tuned_model == model_id))
    if job is None:
        raise not_found("model", model_id)
    return _adapter(job)


@router.delete("/{model_id:path}", response_model=ModelDeleted, responses=error_responses(403, 404, 409))
def delete_model(
    model_id: str, request: Request, session: SessionDep, tenant: CurrentTenant, settings: SettingsDep
) -> ModelDeleted:
    """Delete a fine-tuned model (its adapter and the job's other outputs); base models
    cannot be deleted (403), a model whose job has not ended is a 409."""
    if model_id in request.app.state.base_models:
        raise APIError(403, "base_model_not_deletable",
                       f"'{model_id}' is a base model; only fine-tuned models can be deleted.",
                       param="model")
    delete_fine_tuned_model(session, tenant, model_id, settings=settings)
    return ModelDeleted(id=model_id)
