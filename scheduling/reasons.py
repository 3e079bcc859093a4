"""Why a job is placed where it is, or waits: a stable code next to the words users read.

``place_job`` returns its reasons as ``Reason`` values. The code is for programs (tests,
metrics, a client deciding whether waiting can help: ``memory_does_not_fit`` never goes
away by itself, ``insufficient_gpus`` does); the message is what ``queue_reason`` and the
estimate show, worded for a person and naming the pool.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class ReasonCode(str, enum.Enum):
    """What kind of reason it is; values are stable (they may be matched on)."""

    FITS = "fits"
    """The estimator's notes on a pool that holds the job (GPU count, offload)."""
    POOL_PINNED_MISSING = "pool_pinned_missing"
    """``placement.pool`` names a pool that does not exist."""
    TRAINER_CANNOT_TRAIN = "trainer_cannot_train"
    """The pool runs no trainer family that can train the job's base."""
    GPUS_ABOVE_POOL_LIMIT = "gpus_above_pool_limit"
    """``placement.gpus`` is more than one job may hold in the pool."""
    MEMORY_DOES_NOT_FIT = "memory_does_not_fit"
    """The job does not fit the pool's GPU memory at any allowed GPU count."""
    NO_POOL = "no_pool"
    """No pool is configured at all."""
    QUOTA_BELOW_JOB = "quota_below_job"
    """The tenant's GPU quota in the pool (without borrowing) is smaller than the job."""
    QUOTA_EXCEEDED = "quota_exceeded"
    """The tenant's GPU quota in the pool is used up (waits for its own jobs)."""
    INSUFFICIENT_GPUS = "insufficient_gpus"
    """Not enough free GPUs (or whole nodes) in the pool now (waits for others' jobs)."""
    PREEMPTING = "preempting"
    """Lower-priority jobs are being stopped to make room."""
    WAITING_FOR_RELEASE = "waiting_for_release"
    """Jobs already told to stop are releasing the GPUs the job will get."""


# Reasons that pass as the cluster changes: shown together after "waiting: ". A job that
# waits without one of them has no pool that could ever hold it (``no_pool_fits``): the
# scheduler fails it unless it asked to wait anyway.
WAITING = frozenset({ReasonCode.QUOTA_EXCEEDED, ReasonCode.INSUFFICIENT_GPUS})


@dataclass(frozen=True)
class Reason:
    """One reason: its code, the user's words, and the pool it is about (if one)."""

    code: ReasonCode
    message: str
    pool: str | None = None

    def __str__(self) -> str:
        return self.message


def messages(reasons: Iterable[Reason]) -> tuple[str, ...]:
    """The reasons as users read them: the passing ones (quota, free GPUs) joined into one
    ``"waiting: ..."`` sentence first, then each of the others."""
    reasons = list(reasons)
    waits = [r.message for r in reasons if r.code in WAITING]
    others = [r.message for r in reasons if r.code not in WAITING]
    return ((f"waiting: {'; '.join(waits)}",) if waits else ()) + tuple(others)
