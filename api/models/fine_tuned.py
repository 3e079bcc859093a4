"""Fine-tuned models: the adapter a succeeded job exported, named by ``fine_tuned_model``.

A fine-tuned model exists while its adapter does: deleting the model deletes the job's
outputs (the adapter and the files exported with it), after which the model is neither
listed nor retrievable. The job itself, its checkpoints and its results file stay. A model
that an unfinished job continues (``api.jobs.lineage``) cannot be deleted until that job ends.
"""

from __future__ import annotations

import logging

from sqlalchemy import delete, exists, select
from sqlalchemy.orm import Session

from control.artifacts import store_for
from control.db.models import TERMINAL_STATUSES, Artifact, Job, Tenant
from control.errors import APIError, not_found
from control.reports.ingest import ADAPTER_WEIGHTS, is_inside, job_storage
from control.settings import Settings

log = logging.getLogger(__name__)


def tenant_adapters(tenant_id: str):
    """The tenant's succeeded jobs whose adapter is still there (one fine-tuned model each)."""
    return select(Job).where(
        Job.tenant_id == tenant_id, Job.status == "succeeded", Job.fine_tuned_model.is_not(None),
        exists().where(Artifact.job_id == Job.id, Artifact.name == ADAPTER_WEIGHTS),
    )


def delete_fine_tuned_model(session: Session, tenant: Tenant, model_id: str, *, settings: Settings) -> None:
    """Delete the tenant's fine-tuned model ``model_id``: its job's outputs, rows and objects.

    Raises:
        APIError: 404 ``not_found`` for a model the tenant does not own (or that is already
            deleted); 409 ``job_not_finished`` while the job that makes it has not ended;
            409 ``model_in_use`` while a job that continues it (of any tenant it is shared
            with) has not ended.
    """
    job = session.scalar(tenant_adapters(tenant.id).where(Job.fine_tuned_model == model_id))
    if job is None:
        unfinished = session.scalar(select(Job.id).where(
            Job.tenant_id == tenant.id, Job.fine_tuned_model == model_id,
            Job.status.not_in(TERMINAL_STATUSES),
        ))
        if unfinished is not None:
            raise APIError(409, "job_not_finished",
                           f"Model '{model_id}' is still being made by job '{unfinished}'; "
                           "delete it once the job has ended.", param="model")
        raise not_found("model", model_id, param="model")
    child = session.scalar(select(Job.id).where(Job.model == model_id, Job.status.not_in(TERMINAL_STATUSES)))
    if child is not None:
        raise APIError(409, "model_in_use", f"Job '{child}' continues '{model_id}' and has not ended; delete the "
                       "model once it has (or cancel it).", param="model")
    outputs = job_storage(job.id, settings).outputs
    artifacts = session.scalars(select(Artifact).where(Artifact.job_id == job.id)).all()
    # Every object under the job's output locations: the registered files and anything else
    # the trainer left there. A location outside them (never written by this service) is
    # not touched.
    roots = {row.location for row in artifacts if is_inside(row.location, outputs)} | set(outputs)
    session.execute(delete(Artifact).where(Artifact.job_id == job.id))
    session.commit()
    for root in sorted(roots):
        store = store_for(root, s3_endpoint_url=settings.s3_endpoint_url)
        for key in store.list():
            store.delete(key)
    log.info("deleted fine-tuned model %s (outputs of job %s)", model_id, job.id)
