"""What the scheduler needs to know about a queued job, as one immutable value.

The DB adapter (``worker.scheduler.store``) builds a ``JobRequest`` from a job row and
its base model's config; placement, ordering and the cycle only ever see these, which
keeps them pure and lets the benchmarks build 10,000 of them without a database.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from worker.scheduler.estimator import ModelShape, TrainingShape

TrainerChoice = Literal["auto", "jax_lora", "fsdp_qlora"]

# Same numbers as the API (api/schemas/jobs.py): 0-100, named levels in between.
PRIORITIES: dict[str, int] = {"low": 25, "normal": 50, "high": 75}


def priority_value(name: str | int) -> int:
    """Map the API's priority name (or an int) to the number the scheduler orders by."""
    if isinstance(name, int):
        return name
    try:
        return PRIORITIES[name]
    except KeyError:
        raise ValueError(f"unknown priority {name!r}; use one of {', '.join(PRIORITIES)}") from None


@dataclass(frozen=True)
class JobRequest:
    """A queued job as the scheduler sees it."""

    job_id: str
    tenant: str
    model: ModelShape
    training: TrainingShape
    priority: int = 50
    created_at: float = 0.0
    total_tokens: int | None = None
    trainer: TrainerChoice = "auto"
    """A resumed job keeps its trainer family (its checkpoint format)."""
    pool: str | None = None
    """A pool the user pinned (``placement.pool``)."""
    gpus: int | None = None
    """A GPU count the user pinned (``placement.gpus``)."""
    preemptible: bool = True
