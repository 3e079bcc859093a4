"""The fine-tuned model a new job continues from, when its ``model`` names one.

As OpenAI's, a job's ``model`` may be a fine-tuned model (``ft:...``, the caller's own or one
another tenant shares with it through a checkpoint permission) or one of its checkpoints
(``ft:...:ckpt-step-<N>``, as ``GET /v1/fine_tuning/jobs/{id}/checkpoints`` lists them).
The job then trains a new adapter beside that model's, frozen, on the same base weights,
stored as the parent stored them (``trainers.common.lineage``): the new job's adapter
quantization is the parent's, and its ``base_model`` the base at the root of the lineage.

Refusals (400, ``param`` ``model`` unless said):

- ``invalid_model``: no such fine-tuned model for this tenant (another tenant's, unshared,
  is not confirmed to exist), or its adapter is no longer stored, or its base model has
  left the registry;
- ``parent_not_succeeded``: the job that makes it has not succeeded (its checkpoints
  included: a job continues finished models only);
- ``parent_base_mismatch`` (``param`` ``adapter.<field>``): the body names another base
  storage (LoRA / QLoRA, quantization, double_quant) than the parent trained on;
- ``parent_base_unsupported`` (``param`` ``trainer``): the named trainer cannot train the
  parent's base storage (the JAX trainer and an HQQ or double-quantized NF4 parent).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from api.checkpoint_permissions.queries import sharing_owner
from api.jobs.schemas import JobCreate
from control.db.models import Job
from control.errors import APIError
from control.job_settings import AdapterSettings, JobSettings, ParentSettings
from control.jobs.adapters import adapter_location
from control.jobs.naming import parse_model_name
from control.models.base_models import BaseModelEntry, BaseModelRegistry
from control.settings import Settings
from trainers.spec import trains_base

# How the frozen base is stored: what a job takes from the model it continues.
BASE_STORAGE = ("method", "quantization", "double_quant", "hqq_group_size")


@dataclass(frozen=True)
class ParentModel:
    """A fine-tuned model a job may continue: the settings the job records, its base model
    (the lineage's root) and the adapter settings of the job that made it."""

    settings: ParentSettings
    base: BaseModelEntry
    adapter: AdapterSettings


def resolve_parent(session: Session, tenant_id: str, settings: Settings, base_models: BaseModelRegistry,
                   model_id: str) -> ParentModel | None:
    """The fine-tuned model ``model_id`` names for ``tenant_id``; None when it names none
    (a base model, or an unknown id, which the base model check refuses).

    Raises:
        APIError: ``invalid_model`` or ``parent_not_succeeded`` (module docstring).
    """
    name = parse_model_name(model_id)
    if base_models.get(model_id) is not None or name is None:
        return None
    job = session.get(Job, name.job_id)
    visible = job is not None and name.names(job) and (
        job.tenant_id == tenant_id or sharing_owner(session, model_id, tenant_id) is not None)
    if not visible:
        raise APIError(400, "invalid_model", f"The fine-tuned model '{model_id}' does not exist or you do not "
                       "have access to it.", param="model")
    assert job is not None
    if job.status != "succeeded":
        raise APIError(400, "parent_not_succeeded",
                       f"'{model_id}' is a model of job {job.id}, which is {job.status}: a job continues the "
                       "models (and checkpoints) of succeeded jobs only.", param="model")
    if adapter_location(session, settings, job, name.step) is None:
        raise APIError(400, "invalid_model", f"The fine-tuned model '{model_id}' is no longer stored (it was "
                       "deleted, or is a checkpoint its job did not keep).", param="model")
    base = base_models.get(job.base_model)
    if base is None:
        raise APIError(400, "invalid_model", f"The base model '{job.base_model}' of '{model_id}' is no longer "
                       "in the registry.", param="model")
    made_by = JobSettings.from_row(job)
    return ParentModel(ParentSettings.of(model_id, job.id, name.step, made_by), base, made_by.adapter)


def child_settings(body: JobCreate, parent: ParentModel, settings: JobSettings) -> JobSettings:
    """``settings`` of a job that continues ``parent``: its base stored as the parent's, and
    the parent recorded. ``hyperparameters``, ``r``, ``alpha`` and the modules are the
    body's own.

    Raises:
        APIError: ``parent_base_mismatch``, ``parent_base_unsupported`` (module docstring).
    """
    given = body.adapter.model_dump(include=set(BASE_STORAGE) & body.adapter.model_fields_set, exclude_none=True)
    wanted = AdapterSettings.model_validate({**settings.adapter.stored(), **given}) if given else None
    for field in BASE_STORAGE:
        if wanted is not None and field in given and getattr(wanted, field) != getattr(parent.adapter, field):
            raise APIError(
                400, "parent_base_mismatch",
                f"'{parent.settings.model}' trained on its base with adapter.{field} "
                f"{getattr(parent.adapter, field)!r}; a job that continues it trains on the same base weights: "
                f"leave adapter.{field} out (or give the parent's).", param=f"adapter.{field}")
    storage = {field: getattr(parent.adapter, field) for field in BASE_STORAGE}
    adapter = AdapterSettings.model_validate({**settings.adapter.stored(), **storage})
    child = settings.model_copy(update={"adapter": adapter, "parent": parent.settings})
    if not trains_base(child.trainer, adapter.quantization, adapter.double_quant):
        base = f"{adapter.quantization} base" + (" with double_quant" if adapter.double_quant else "")
        raise APIError(
            400, "parent_base_unsupported",
            f"'{parent.settings.model}' was trained on a {base}, which the {child.trainer} trainer does not train "
            "(it trains bf16/fp32 weights or NF4 without double_quant); use trainer 'fsdp_qlora' or 'auto'.",
            param="trainer")
    return child
