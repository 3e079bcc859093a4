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

import re
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.checkpoint_permissions.queries import sharing_owner
from api.models.fine_tuned import tenant_adapters
from control.db.models import Artifact, Checkpoint, Job
from control.errors import APIError
from control.jobs.naming import fine_tuned_model_id
from control.models.base_models import BaseModelEntry
from control.reports.ingest import ADAPTER_WEIGHTS, is_inside, job_storage
from control.settings import Settings

ADAPTER_DIR = "adapter"
_CHECKPOINT = re.compile(r"^(?P<model>ft:.+):ckpt-step-(?P<step>\d{1,12})$")


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
    checkpoint = _CHECKPOINT.match(model_id)
    if checkpoint is not None:
        job, path = _checkpoint_adapter(session, tenant_id, settings, checkpoint["model"], int(checkpoint["step"]))
    else:
        job = session.scalar(tenant_adapters(tenant_id).where(Job.fine_tuned_model == model_id))
        row = job and session.scalar(
            select(Artifact).where(Artifact.job_id == job.id, Artifact.name == ADAPTER_WEIGHTS))
        if row is None or not is_inside(row.location, job_storage(job.id, settings).outputs):
            raise model_not_found(model_id)
        path = f"{row.location.rstrip('/')}/{ADAPTER_DIR}"
    base = base_models.get(job.model)
    if base is None:
        raise APIError(404, "model_not_found",
                       f"The base model '{job.model}' of '{model_id}' is no longer in the registry.", param="model")
    return ServedModel(model_id, base, path)


def _checkpoint_adapter(session: Session, tenant_id: str, settings: Settings, model: str,
                        step: int) -> tuple[Job, str]:
    job_id = model.rsplit(":", 1)[-1]
    job = session.get(Job, job_id)
    if job is None or job.tenant_id != tenant_id or fine_tuned_model_id(job) != model:
        raise model_not_found(f"{model}:ckpt-step-{step}")
    row = session.scalar(select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step == step))
    if row is None or not is_inside(row.location, job_storage(job.id, settings).checkpoints):
        raise model_not_found(f"{model}:ckpt-step-{step}")
    return job, f"{row.location.rstrip('/')}/{ADAPTER_DIR}"
