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

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from control.job_settings import JobSettings, PlacementSettings, TrainerChoice, samples_per_prompt
from scheduling.estimator import ModelShape, TrainingShape
from scheduling.priorities import DEFAULT_PRIORITY


@dataclass(frozen=True)
class DataStats:
    """A training file's rows in tokens after the chat template, as its validation report
    records them (``token_stats`` of ``trainers.common.formats``): an upper bound from the
    bytes (``method="bytes"``) or the base model's tokenizer's count (``"tokenizer"``)."""

    rows: int
    longest_row: int
    longest_row_line: int | None
    total_tokens: int
    total_tokens_estimate: int
    method: str = "bytes"

    @classmethod
    def from_report(cls, report: Mapping[str, Any] | None) -> DataStats | None:
        """The stats of a validation report; None for a report without them (a file
        validated before they were recorded, or not validated yet)."""
        stats = (report or {}).get("token_stats")
        if not isinstance(stats, Mapping) or not stats.get("rows") or not stats.get("longest_row"):
            return None
        total = int(stats.get("total_tokens") or 0)
        return cls(rows=int(stats["rows"]), longest_row=int(stats["longest_row"]),
                   longest_row_line=stats.get("longest_row_line"), total_tokens=total,
                   total_tokens_estimate=int(stats.get("total_tokens_estimate") or total),
                   method=str(stats.get("method") or "bytes"))


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
    longest_row: str | None = None
    """The row the memory plan is sized by, in words ("line 17, 3,120 tokens"), for the
    reason a job that does not fit is given; None when planned at ``max_seq_len``."""


def planned_seq_len(settings: JobSettings, data: DataStats | None = None) -> int:
    """The sequence length memory is planned for: the training file's longest row
    (truncated to ``max_seq_len``, as the trainers truncate), or ``max_seq_len`` when the
    rows are not known yet or the job packs rows (a packed sequence fills ``max_seq_len``)."""
    if data is None or settings.packing:
        return settings.max_seq_len
    longest = data.longest_row
    if settings.method.type == "reinforcement":  # a prompt and its sampled completion
        longest += settings.method.max_completion_tokens  # type: ignore[union-attr]
    return max(1, min(longest, settings.max_seq_len))


def longest_row_words(settings: JobSettings, data: DataStats | None) -> str | None:
    """The row the plan is sized by, in words (None when planned at ``max_seq_len``)."""
    if data is None or settings.packing:
        return None
    bound = "at most " if data.method == "bytes" else ""
    where = f"line {data.longest_row_line}, " if data.longest_row_line is not None else ""
    words = f"{where}{bound}{data.longest_row:,} tokens"
    if data.longest_row > settings.max_seq_len:
        words += f", truncated to max_seq_len {settings.max_seq_len:,}"
    return words


def training_shape(settings: JobSettings, data: DataStats | None = None) -> TrainingShape:
    """The job settings that decide memory: adapter (and a parent fine-tuned model's, frozen),
    sequence length (the longest row of the training file when known, ``planned_seq_len``),
    micro batch and objective (a DPO job holds two sequences per example).

    A job whose "auto" hyperparameters are not resolved yet, and that names no micro
    batch, is estimated at micro batch 1.
    """
    adapter, parent = settings.adapter, settings.parent
    return TrainingShape(
        method=adapter.method,
        quantization=adapter.quantization,
        double_quant=adapter.double_quant,
        hqq_group_size=adapter.hqq_group_size,
        r=adapter.r,
        target_modules=adapter.target_modules,
        seq_len=planned_seq_len(settings, data),
        micro_batch=settings.hyperparameters.micro_batch_size or 1,
        objective=settings.method.type,  # type: ignore[arg-type]
        group_size=group_size(settings),
        frozen_r=parent.r if parent is not None else 0,
        frozen_target_modules=parent.target_modules if parent is not None else (),
    )


def group_size(settings: JobSettings) -> int:
    """A reinforcement job's completions per prompt (``compute_multiplier`` "auto" counts as
    1.0, its resolved value); 1 for other methods."""
    method = settings.method
    if method.type != "reinforcement":
        return 1
    multiplier = method.compute_multiplier  # type: ignore[union-attr]
    return samples_per_prompt(1.0 if multiplier == "auto" else float(multiplier))


def planned_tokens(settings: JobSettings, data: DataStats | None = None) -> int | None:
    """Tokens the job will process: steps x batch x tokens per example (None: not known yet).

    Tokens per example are the training file's mean row (its ``total_tokens_estimate``,
    each row counted at most ``max_seq_len``) when the rows are known, else
    ``max_seq_len``: a job of short rows is not timed as if each filled the context.
    """
    steps, batch = settings.hyperparameters.total_steps, settings.hyperparameters.batch_size
    if not (isinstance(steps, int) and isinstance(batch, int)):
        return None
    if data is None:
        return steps * batch * settings.max_seq_len or None
    per_row = min(data.total_tokens_estimate, data.rows * settings.max_seq_len) / data.rows
    return math.ceil(steps * batch * per_row) or None


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
    data: DataStats | None = None,
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
        data: the training file's token stats (its validation report's): memory is
            planned for its longest row and time for its tokens; None plans
            ``max_seq_len`` per row.
    """
    pins = placement if placement is not None else settings.placement
    return JobRequest(
        job_id=job_id,
        tenant=tenant,
        model=model,
        training=training_shape(settings, data),
        priority=priority,
        created_at=created_at,
        total_tokens=total_tokens if total_tokens is not None else planned_tokens(settings, data),
        trainer=checkpoint_trainer or settings.trainer,
        pool=pins.pool,
        # Reinforcement runs on one process (the torch trainer samples on one GPU).
        gpus=1 if pins.gpus is None and settings.method.type == "reinforcement" else pins.gpus,
        queue_if_unfit=pins.queue_if_unfit,
        longest_row=longest_row_words(settings, data),
    )
