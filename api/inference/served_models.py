"""Which model a completion request names, and whether the caller may use it.

``model`` is one of:

- a base model id of the registry (``tunefleet-tiny-llama``);
- a fine-tuned model, ``ft:<base>:<org>[:<suffix>]:<job id>``: a succeeded job of the
  caller's tenant whose adapter is still stored (``api.models.fine_tuned``);
- a checkpoint of one, ``<fine-tuned model>:ckpt-step-<N>`` (also of a job still running),
  as ``GET /v1/fine_tuning/jobs/{id}/checkpoints`` lists them;
- either of these of another tenant that shares it with the caller's
  (``api.checkpoint_permissions``), while the permission exists.

Anything else, and every model of another tenant, is the same 404 ``model_not_found``:
another tenant's models are not even confirmed to exist. The answer holds the local
locations the inference worker loads; they never reach the caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy.orm import Session

from api.checkpoint_permissions.queries import sharing_owner
from api.models.fine_tuned import tenant_adapters
from control.db.models import Job
from control.errors import APIError
from control.jobs.adapters import adapter_location
from control.jobs.naming import parse_model_name
from control.models.base_models import BaseModelEntry
from control.settings import Settings


@dataclass(frozen=True)
class ServedModel:
    id: str  # as the caller named it (echoed in responses)
    base: BaseModelEntry
    adapter_path: str | None  # the PEFT adapter directory; None for a base model


def model_not_found(model_id: str) -> APIError:
    return APIError(404, "model_not_found",
                    f"The model '{model_id}' does not exist or you do not have access to it.", param="model")


def resolve_served_model(session: Session, tenant_id: str, settings: Settings,
                         base_models: Mapping[str, BaseModelEntry], model_id: str) -> ServedModel:
    """The model ``model_id`` names for ``tenant_id``, or 404 ``model_not_found``."""
    entry = base_models.get(model_id)
    if entry is not None:
        return ServedModel(model_id, entry, None)
    tenant_id = sharing_owner(session, model_id, tenant_id) or tenant_id  # look among the owner's models
    name = parse_model_name(model_id)
    if name is not None and name.step is not None:  # a checkpoint, also of a job still running
        job = session.get(Job, name.job_id)
        if job is None or job.tenant_id != tenant_id or not name.names(job):
            raise model_not_found(model_id)
    else:
        job = session.scalar(tenant_adapters(tenant_id).where(Job.fine_tuned_model == model_id))
    path = adapter_location(session, settings, job, name.step) if job is not None and name is not None else None
    if path is None:
        raise model_not_found(model_id)
    # A model that continued another was exported folded: one adapter over the root base.
    base = base_models.get(job.base_model)
    if base is None:
        raise APIError(404, "model_not_found",
                       f"The base model '{job.base_model}' of '{model_id}' is no longer in the registry.",
                       param="model")
    return ServedModel(model_id, base, path)
