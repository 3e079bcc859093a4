"""What the scheduler needs to know about a queued job, as one immutable value.

``request_from_job`` is the one mapping from a job's settings (plain values: the base
model's shape, the adapter and hyperparameter dicts, the placement pins, ...) to a
``JobRequest``. The scheduler's store builds every queued job's request with it, and the
API builds the request behind an estimate and behind the estimate stored on a new job
with it, so what a user is shown and what the scheduler decides cannot drift apart.
Placement, ordering and the cycle only ever see ``JobRequest`` values, which keeps them
pure and lets the benchmarks build 10,000 of them without a database.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from scheduling.estimator import ModelShape, TrainingShape
from scheduling.priorities import DEFAULT_PRIORITY
from trainers.spec import DEFAULT_TARGET_MODULES

TrainerChoice = Literal["auto", "jax_lora", "fsdp_qlora"]


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


def training_shape(adapter: Mapping[str, Any], hyperparameters: Mapping[str, Any],
                   max_seq_len: int, method_type: str = "supervised") -> TrainingShape:
    """The job settings that decide memory: adapter, sequence length, micro batch and
    objective (``method_type``: the job's ``method.type``, ``supervised`` or ``dpo``).

    ``micro_batch_size`` counts when it is an int (resolved, or given by the user); a
    job whose "auto" hyperparameters are not resolved yet is estimated at micro batch 1.
    """
    method = adapter.get("method", "lora")
    quant = adapter.get("quantization") or ("nf4" if method == "qlora" else "none")
    micro = hyperparameters.get("micro_batch_size")
    return TrainingShape(
        method=method,
        quantization=quant if method == "qlora" else "none",
        double_quant=bool(adapter.get("double_quant", False)),
        hqq_group_size=int(adapter.get("hqq_group_size", 64)),
        r=int(adapter.get("r", 8)),
        target_modules=tuple(adapter.get("target_modules") or DEFAULT_TARGET_MODULES),
        seq_len=int(max_seq_len),
        micro_batch=micro if isinstance(micro, int) else 1,
        objective="dpo" if method_type == "dpo" else "supervised",
    )


def planned_tokens(hyperparameters: Mapping[str, Any], max_seq_len: int) -> int | None:
    """Tokens the job will process: steps x batch x sequence length (None: not known yet)."""
    steps, batch = hyperparameters.get("total_steps"), hyperparameters.get("batch_size")
    if isinstance(steps, int) and isinstance(batch, int):
        return steps * batch * int(max_seq_len) or None
    return None


def request_from_job(
    *,
    job_id: str,
    tenant: str,
    model: ModelShape,
    adapter: Mapping[str, Any],
    hyperparameters: Mapping[str, Any],
    max_seq_len: int,
    trainer: str,
    placement: Mapping[str, Any],
    priority: int,
    created_at: float = 0.0,
    total_tokens: int | None = None,
    checkpoint_trainer: str | None = None,
    method_type: str = "supervised",
) -> JobRequest:
    """The ``JobRequest`` of a job (or of a would-be job, for an estimate).

    Args:
        job_id: the job's id (an estimate passes a placeholder).
        tenant: the job's tenant id.
        model: the base model's shape.
        adapter: the job's ``adapter`` settings as stored.
        hyperparameters: the job's hyperparameters (resolved, or as requested).
        max_seq_len: the job's sequence length.
        trainer: ``auto``, ``jax_lora`` or ``fsdp_qlora`` (anything else counts as auto).
        placement: the pins (``pool``, ``gpus``) and ``queue_if_unfit``; the store merges an out-of-memory
            retry's larger gang under the user's pins.
        priority: the priority number.
        created_at: Unix seconds (queue order among equals).
        total_tokens: tokens the job processes; None: from the hyperparameters.
        checkpoint_trainer: the family that wrote the checkpoint a resumed job restarts
            from; a checkpoint only resumes in its own family, so it wins over ``trainer``.
        method_type: the job's ``method.type`` (a DPO job holds more per micro batch).
    """
    family = trainer if trainer in ("jax_lora", "fsdp_qlora") else "auto"
    if checkpoint_trainer:
        family = checkpoint_trainer
    return JobRequest(
        job_id=job_id,
        tenant=tenant,
        model=model,
        training=training_shape(adapter, hyperparameters, max_seq_len, method_type),
        priority=priority,
        created_at=created_at,
        total_tokens=total_tokens if total_tokens is not None else planned_tokens(hyperparameters, max_seq_len),
        trainer=family,
        pool=placement.get("pool"),
        gpus=placement.get("gpus"),
        queue_if_unfit=bool(placement.get("queue_if_unfit", False)),
    )
