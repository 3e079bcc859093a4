"""`tunefleet admin manifests`: the Kubernetes objects a job body would get on a pool.

Nothing is created, in the database or the cluster. The body is validated as
``POST /v1/fine_tuning/jobs`` validates it, its hyperparameters resolved against its
(validated) training file as on queueing, placed on the named pool as the scheduler
would place it on an idle pool, turned into the trainer spec by the scheduler's own spec
builder, and rendered by the executor's own ``launch_manifests`` with the options the
scheduler builds from the same settings. Only the report token (minted at admission) is
a placeholder.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from control.settings import Settings
    from worker.executors.manifests import JobManifests

PREVIEW_JOB_ID = "ftjob-preview"
TOKEN_PLACEHOLDER = "<the job's report token, minted at admission>"


@dataclasses.dataclass
class PreviewError(Exception):
    """The body cannot run on the pool; ``code`` is stable, ``param`` says where."""

    code: str
    message: str
    param: str | None = None


def preview_manifests(settings: Settings, body: dict[str, Any], pool_name: str, *,
                      tenant: str = "org-preview") -> JobManifests:
    """The objects the Kubernetes executor would create for ``body`` admitted on ``pool_name``.

    Raises:
        PreviewError: an invalid body, an unknown pool or file, or a job the pool cannot hold.
    """
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from api.errors import validation_error
    from api.fleet.estimate import job_request
    from api.jobs.commands import base_model_and_settings
    from api.jobs.schemas import JobCreate
    from control.db.models import File, Job
    from control.db.session import session_scope
    from control.errors import APIError
    from control.jobs.hyperparameters import resolve_settings
    from control.models.base_models import load_base_models
    from scheduling.capacity import CapacitySnapshot
    from scheduling.model_shapes import EstimateError
    from scheduling.placement import place_job
    from scheduling.pools import load_pools
    from worker.executors.manifests import launch_manifests
    from worker.scheduler.loop import manifest_options, trainer_env
    from worker.spec_builder import SpecError, build_spec

    pools = {p.name: p for p in load_pools(settings.node_pools_file)}
    if pool_name not in pools:
        raise PreviewError("invalid_pool", f"Unknown node pool '{pool_name}'. Available: {', '.join(pools)}.",
                           "pool")
    pool = pools[pool_name]
    try:
        job_body = JobCreate.model_validate(body)
        entry, job_settings = base_model_and_settings(job_body, load_base_models(settings))
    except ValidationError as exc:  # worded as the API words it
        error = validation_error(RequestValidationError(exc.errors()))
        raise PreviewError(error.code, error.message, error.param) from exc
    except APIError as exc:
        raise PreviewError(exc.code, exc.message, exc.param) from exc
    with session_scope(settings.resolved_database_url) as session:
        train = session.get(File, job_body.training_file)
        if train is None or train.deleted_at is not None or train.status != "processed":
            state = "does not exist" if train is None or train.deleted_at else f"is {train.status}"
            raise PreviewError("invalid_file", f"training file '{job_body.training_file}' {state}; the "
                               "preview needs a validated file (its format and example count).", "training_file")
        job_settings = resolve_settings(job_settings, int((train.validation or {}).get("n_examples") or 0))
        try:
            inp = job_request(entry, job_settings, job_id=PREVIEW_JOB_ID, tenant=tenant,
                              priority=job_body.priority_value,
                              placement=job_settings.placement.model_copy(update={"pool": pool.name}))
        except EstimateError as exc:  # e.g. model_unavailable: the model's files are not there
            raise PreviewError(exc.code, str(exc), "model") from exc
        # The pool idle, with as many nodes as one job may span.
        idle = pool.model_copy(update={"nodes": max(pool.nodes, pool.max_nodes_per_job)})
        placement = place_job(inp.request, CapacitySnapshot.from_pools([idle]))
        if placement.mode != "fit":
            raise PreviewError("no_fit", f"the job cannot run on pool {pool.name}: {placement.reason_text()}",
                               "placement")
        job = Job(id=PREVIEW_JOB_ID, tenant_id=tenant, model=job_body.model, base_model=entry.id,
                  training_file=train.id, validation_file=job_body.validation_file, priority=job_body.priority_value,
                  suffix=job_body.suffix, **job_settings.row_columns())
        try:
            spec = build_spec(session, job, settings, pool_accelerator=pool.accelerator,
                              pool_families=(placement.trainer or pool.preferred_trainer(),), gpus=placement.gpus,
                              token=TOKEN_PLACEHOLDER, in_cluster=True, cpu_offload=placement.offload)
        except SpecError as exc:
            raise PreviewError(exc.code, exc.message) from exc
        session.rollback()  # read only
    nodes = max(1, len(placement.nodes))
    return launch_manifests(spec, tenant=tenant, priority=job_body.priority_value, pool=pool,
                            trainer=placement.trainer or pool.preferred_trainer(), nodes=nodes,
                            gpus_per_node=placement.gpus // nodes, opts=manifest_options(settings), attempt=1, run=1,
                            extra_env=trainer_env(settings, os.environ) or None)
