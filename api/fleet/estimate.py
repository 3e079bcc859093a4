"""Placement estimates: what a job (stored, or the body of one not yet submitted) would get.

The decisions come from the pure ``scheduling`` package (capacity, estimator, placement,
the job -> request mapping ``request_from_job``), the same functions the scheduler runs,
so the estimate a user sees before submitting, the estimate stored on a new job and the
scheduler's own placement cannot drift apart. The job's side is its
``control.job_settings.JobSettings``: parsed from the row of a stored job, built from the
body of one not yet submitted as job creation builds it. This module adds the database
reads around them and the response shape; the capacity now comes from ``api.fleet.pools``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from api.files.queries import get_file
from api.fleet.pools import capacity_snapshot
from api.fleet.schemas import EstimateRequest
from api.jobs.commands import base_model_and_settings
from api.jobs.lineage import resolve_parent
from control.db.models import File, Job, Tenant
from control.errors import APIError
from control.job_settings import AUTO, JobSettings
from control.jobs.hyperparameters import micro_batch_for, resolve_settings
from control.models.base_models import BaseModelEntry, BaseModelRegistry
from control.settings import Settings
from scheduling.capacity import CapacitySnapshot
from scheduling.estimator import HEADROOM, EstimateError, PoolEstimate
from scheduling.model_files import base_model_shape
from scheduling.placement import (
    Placement,
    PreemptionPolicy,
    estimate_for,
    no_pool_fits,
    place_job,
    trainer_for,
    trainer_refusal,
)
from scheduling.pools import NodePool
from scheduling.request import DataStats, JobRequest, request_from_job

log = logging.getLogger(__name__)


# ---- from a job (or a job-shaped body) to what the scheduler sees ----------------------


def _estimable(settings: JobSettings) -> JobSettings:
    """The settings with the micro batch a given batch size resolves to (the ``"auto"``
    rule of ``control.jobs.hyperparameters``), so an estimate before the training file is
    validated counts the micro batch the job will run with."""
    hp = settings.hyperparameters
    if hp.micro_batch_size is not None or hp.batch_size == AUTO:
        return settings
    micro = micro_batch_for(hp.batch_size)
    return settings.model_copy(update={"hyperparameters": hp.model_copy(update={"micro_batch_size": micro})})


@dataclass(frozen=True)
class EstimateInput:
    """A job, or a would-be job, as the estimate needs it."""

    request: JobRequest
    model_id: str
    shape_source: str
    notes: tuple[str, ...] = ()


def job_request(entry: BaseModelEntry, settings: JobSettings, **job: Any) -> EstimateInput:
    """What the estimate needs of a job, or of a would-be job, on the base model ``entry``.

    Args:
        entry: the job's base model; its shape comes from its ``config.json`` when it has one.
        settings: the job's settings.
        **job: the rest of what ``scheduling.request.request_from_job`` takes (``job_id``,
            ``tenant``, ``priority``, ...): the one job -> request mapping, the scheduler's too.
    """
    shape, source = base_model_shape(entry.path, entry.params_b, model_id=entry.id)
    # "auto" stays auto: placement picks the family per pool (``trainer_for``), as the
    # scheduler does for the queued job.
    req = request_from_job(model=shape, settings=_estimable(settings), **job)
    notes = [] if source == "config.json" else [f"model shape from the {source}: an approximation"]
    if req.total_tokens is None:
        notes.append(
            "no example count yet: ETA and cost need training_file, n_examples or total_tokens"
        )
    return EstimateInput(req, entry.id, source, tuple(notes))


# ---- the estimate --------------------------------------------------------------------


def _breakdown(est: PoolEstimate) -> dict[str, int] | None:
    m = est.memory
    if m is None:
        return None
    return {
        "weights": m.weights + m.gathered_layer + m.dequantized_layer,
        "lora": m.lora_params,
        "grads": m.lora_grads,
        "optimizer": m.optimizer,
        "activations": m.activations + m.logits,
        "overhead": m.slack + m.framework,
    }


def _pool_row(
    pool: NodePool, est: PoolEstimate | None, free: int, reasons: list[str]
) -> dict[str, Any]:
    row = {
        "pool": pool.name,
        "accelerator": pool.accelerator,
        "fits": False,
        "gpus": 0,
        "nodes": 0,
        "cpu_offload": False,
        "trainer": None,
        "memory_per_gpu_bytes": None,
        "capacity_bytes": pool.gpu_memory_bytes,
        "usable_bytes": int(pool.gpu_memory_bytes * HEADROOM),
        "gpu_memory_bytes": pool.gpu_memory_bytes,
        "breakdown": None,
        "tokens_per_s": 0.0,
        "eta_s": None,
        "cost": None,
        "gpus_free": free,
        "reasons": reasons,
    }
    if est is not None:
        row.update(
            {
                "fits": est.fits,
                "gpus": est.gpus,
                "nodes": est.nodes,
                "cpu_offload": est.offload,
                "trainer": est.trainer,
                "memory_per_gpu_bytes": est.bytes_per_gpu,
                "breakdown": _breakdown(est),
                "tokens_per_s": round(est.tokens_per_s, 1),
                "eta_s": _round(est.eta_s, 1),
                "cost": _round(est.cost, 4),
                "reasons": list(est.reasons) + reasons,
            }
        )
    return row


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _chosen(placement: Placement, mode: str, reasons: tuple[str, ...]) -> dict[str, Any] | None:
    est = placement.estimate
    if placement.pool is None or est is None:
        return None
    return {
        "pool": placement.pool,
        "gpus": placement.gpus,
        "mode": mode,
        "trainer": placement.trainer,
        "fits": True,
        "cpu_offload": est.offload,
        "memory_per_gpu_bytes": est.bytes_per_gpu,
        "tokens_per_s": round(est.tokens_per_s, 1),
        "eta_s": _round(est.eta_s, 1),
        "cost": _round(est.cost, 4),
        "preempts": len(placement.victims),
        "reasons": list(reasons),
    }


def estimate(
    pools: list[NodePool], snapshot: CapacitySnapshot, inp: EstimateInput
) -> dict[str, Any]:
    """Every pool's estimate and a dry run of placement now (the ``fine_tuning.estimate`` object).

    ``chosen`` is where the scheduler would place the job now (``fit``, or
    ``fit_after_preemption``); when the fleet is busy (``no_fit``) it is the pool the job
    would take on an idle fleet, with the reasons it waits; None when no pool can ever
    hold it. ``unfit`` lists, when no pool's configuration can hold the job at all
    (``scheduling.placement.no_pool_fits``), each pool's reason; it is empty otherwise.
    """
    req = inp.request
    rows: list[dict[str, Any]] = []
    for pool in pools:
        free = snapshot.pool_free(pool.name)
        trainer = trainer_for(req, pool)
        limit = pool.gpus_per_node * pool.max_nodes_per_job
        if trainer is None:
            rows.append(_pool_row(pool, None, free, [f"{pool.name}: {trainer_refusal(req, pool)}"]))
            continue
        if req.gpus is not None and req.gpus > limit:
            rows.append(
                _pool_row(pool, None, free, [f"{pool.name} allows at most {limit} GPUs per job"])
            )
            continue
        extra = (
            [f"not considered: placement.pool pins the job to {req.pool}"]
            if req.pool not in (None, pool.name)
            else []
        )
        rows.append(_pool_row(pool, estimate_for(req, pool, trainer), free, extra))
    now = place_job(req, snapshot, policy=PreemptionPolicy())
    chosen = None
    if now.mode != "no_fit":
        chosen = _chosen(now, now.mode, now.messages())
    else:
        idle = place_job(req, CapacitySnapshot.from_pools(pools))
        if idle.mode == "fit":
            chosen = _chosen(idle, "no_fit", now.messages())
    return {
        "object": "fine_tuning.estimate",
        "model": {"id": inp.model_id, "params": req.model.params, "shape_source": inp.shape_source},
        "total_tokens": req.total_tokens,
        "mode": now.mode,
        "reasons": list(now.messages()),
        "pools": rows,
        "chosen": chosen,
        "unfit": [
            {"pool": r.pool, "code": r.code.value, "message": r.message}
            for r in no_pool_fits(req, {p.name: p for p in pools})
        ],
        "notes": list(inp.notes),
    }


def _estimate_error(exc: EstimateError) -> APIError:
    param = {
        "model_not_found": "model",
        "model_config_unavailable": "model",
        "model_unavailable": "model",
        "invalid_model_config": "model",
        "invalid_adapter": "adapter",
    }.get(exc.code)
    return APIError(400, exc.code, str(exc), param=param)


def estimate_request(
    session: Session,
    tenant: Tenant,
    body: EstimateRequest,
    *,
    base_models: BaseModelRegistry,
    pools: list[NodePool],
    settings: Settings,
) -> dict[str, Any]:
    """``POST /v1/fine_tuning/estimate``: validate the job-shaped body (a fine-tuned model
    as ``model`` included: ``api.jobs.lineage``), then estimate."""
    parent = resolve_parent(session, tenant.id, settings, base_models, body.model)
    entry, job_settings = base_model_and_settings(body, base_models, parent=parent)
    if body.placement.pool is not None and body.placement.pool not in {p.name for p in pools}:
        raise APIError(
            400,
            "invalid_request",
            f"Unknown node pool '{body.placement.pool}'. Available: "
            f"{', '.join(p.name for p in pools)}.",
            param="placement.pool",
        )
    n_examples = body.n_examples
    data = None
    if body.training_file is not None:
        n_examples, data = _file_examples(session, tenant, body.training_file, given=n_examples)
    if n_examples:
        job_settings = resolve_settings(job_settings, n_examples)
    try:
        inp = job_request(entry, job_settings, job_id="estimate", tenant=tenant.id,
                          priority=body.priority_value, total_tokens=body.total_tokens, data=data)
        return estimate(pools, capacity_snapshot(session, pools), inp)
    except EstimateError as exc:
        raise _estimate_error(exc) from exc


def _file_examples(
    session: Session, tenant: Tenant, file_id: str, *, given: int | None
) -> tuple[int | None, DataStats | None]:
    """The training file's example count (``given`` wins) and token stats (None while
    it is being validated)."""
    try:
        file: File = get_file(session, tenant, file_id, param="training_file")
    except APIError:
        raise APIError(
            400, "invalid_file", f"No file found with id '{file_id}'.", param="training_file"
        ) from None
    if file.purpose != "fine-tune":
        raise APIError(
            400,
            "invalid_file",
            f"File '{file_id}' has purpose '{file.purpose}', not 'fine-tune'.",
            param="training_file",
        )
    if file.status == "error":
        raise APIError(
            400,
            "invalid_file",
            f"File '{file_id}' failed validation; fix it before estimating.",
            param="training_file",
        )
    data = DataStats.from_report(file.validation)
    if given is not None:
        return given, data
    n = int((file.validation or {}).get("n_examples") or 0)
    return n or None, data  # still being validated: no count yet


def estimate_job(
    session: Session, job: Job, *, base_models: dict[str, BaseModelEntry], pools: list[NodePool]
) -> dict[str, Any]:
    """The estimate of a stored job (job creation saves it on ``job.estimate``)."""
    entry = base_models.get(job.base_model)
    if entry is None:
        raise EstimateError(f"base model {job.base_model!r} is not configured", "model_not_found")
    train = session.get(File, job.training_file) if job.training_file else None
    inp = job_request(entry, JobSettings.from_row(job), job_id=job.id, tenant=job.tenant_id,
                      priority=int(job.priority or 0),
                      data=DataStats.from_report(train.validation) if train is not None else None)
    return estimate(pools, capacity_snapshot(session, pools), inp)
