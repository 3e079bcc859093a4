"""What the scheduler needs to know about a queued job, as one immutable value.

``request_from_job`` is the one mapping from a job's settings (the typed
``control.job_settings.JobSettings``, with the base model's shape beside it) to a
``JobRequest``. The scheduler's store builds every queued job's request with it, and the
API builds the request behind an estimate and behind the estimate stored on a new job
with it, so what a user is shown and what the scheduler decides cannot drift apart.
Placement, ordering and the cycle only ever see ``JobRequest`` values, which keeps them
pure and lets the benchmarks build 10,000 of them without a database.
"""

from __future__ import annotations

from dataclasses import dataclass

from control.job_settings import JobSettings, PlacementSettings, TrainerChoice
from scheduling.estimator import ModelShape, TrainingShape
from scheduling.priorities import DEFAULT_PRIORITY


@dataclass(frozen=True)
class JobRequest:
    """A queued job as the scheduler sees it."""

    job_id: str
    tenant: str
    model: ModelShape
    training: TrainingShape
    priority: int = DEFAULT_PRIORITY
    created_at: float = 0.0
    total_tokens: int | None = None
    trainer: TrainerChoice = "auto"
    """A resumed job keeps its trainer family (its checkpoint format)."""
    pool: str | None = None
    """A pool the user pinned (``placement.pool``)."""
    gpus: int | None = None
    """A GPU count the user pinned (``placement.gpus``)."""
    preemptible: bool = True
    queue_if_unfit: bool = False
    """The user asked to queue the job although no pool can hold it (``placement.queue_if_unfit``:
    a pool is being grown); otherwise such a job fails (``scheduling.placement.no_pool_fits``)."""


def training_shape(settings: JobSettings) -> TrainingShape:
    """The job settings that decide memory: adapter, sequence length, micro batch and
    objective (a DPO job holds two sequences per example).

    A job whose "auto" hyperparameters are not resolved yet, and that names no micro
    batch, is estimated at micro batch 1.
    """
    adapter = settings.adapter
    return TrainingShape(
        method=adapter.method,
        quantization=adapter.quantization,
        double_quant=adapter.double_quant,
        hqq_group_size=adapter.hqq_group_size,
        r=adapter.r,
        target_modules=adapter.target_modules,
        seq_len=settings.max_seq_len,
        micro_batch=settings.hyperparameters.micro_batch_size or 1,
        objective="dpo" if settings.method.type == "dpo" else "supervised",
    )


def planned_tokens(settings: JobSettings) -> int | None:
    """Tokens the job will process: steps x batch x sequence length (None: not known yet)."""
    steps, batch = settings.hyperparameters.total_steps, settings.hyperparameters.batch_size
    if isinstance(steps, int) and isinstance(batch, int):
        return steps * batch * settings.max_seq_len or None
    return None


def request_from_job(
    *,
    job_id: str,
    tenant: str,
    model: ModelShape,
    settings: JobSettings,
    priority: int,
    created_at: float = 0.0,
    total_tokens: int | None = None,
    checkpoint_trainer: str | None = None,
    placement: PlacementSettings | None = None,
) -> JobRequest:
    """The ``JobRequest`` of a job (or of a would-be job, for an estimate).

    Args:
        job_id: the job's id (an estimate passes a placeholder).
        tenant: the job's tenant id.
        model: the base model's shape.
        settings: the job's settings (hyperparameters resolved, or as requested).
        priority: the priority number.
        created_at: Unix seconds (queue order among equals).
        total_tokens: tokens the job processes; None: from the hyperparameters.
        checkpoint_trainer: the family that wrote the checkpoint a resumed job restarts
            from; a checkpoint only resumes in its own family, so it wins over the
            settings' trainer.
        placement: the pins to place by, when not the settings' own: the store adds an
            out-of-memory retry's larger gang under the user's pins, a manifest preview
            pins its pool.
    """
    pins = placement if placement is not None else settings.placement
    return JobRequest(
        job_id=job_id,
        tenant=tenant,
        model=model,
        training=training_shape(settings),
        priority=priority,
        created_at=created_at,
        total_tokens=total_tokens if total_tokens is not None else planned_tokens(settings),
        trainer=checkpoint_trainer or settings.trainer,
        pool=pins.pool,
        gpus=pins.gpus,
        queue_if_unfit=pins.queue_if_unfit,
    )
