"""Query functions for held-out evaluations: a job's list, one of them, and those an API
process may take over (unheld, or held by a runner that stopped)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.pagination import page_newest_first
from control.db.models import Evaluation, Job
from control.errors import not_found

UNDER_WAY = ("queued", "running")


def job_evaluations(session: Session, job: Job, *, after: str | None, limit: int) -> tuple[list[Evaluation], bool]:
    """One page of ``job``'s evaluations, newest first."""
    return page_newest_first(session, select(Evaluation).where(Evaluation.job_id == job.id), Evaluation,
                             after=after, limit=limit)


def get_evaluation(session: Session, job: Job, evaluation_id: str) -> Evaluation:
    row = session.get(Evaluation, evaluation_id)
    if row is None or row.job_id != job.id:
        raise not_found("evaluation", evaluation_id)
    return row


def under_way(session: Session, tenant_id: str) -> int:
    """How many evaluations of the tenant are queued or running."""
    return session.scalar(select(func.count()).select_from(Evaluation).where(
        Evaluation.tenant_id == tenant_id, Evaluation.status.in_(UNDER_WAY))) or 0


@dataclass(frozen=True)
class Claim:
    """Who holds an evaluation under way, as last read: a take-over compares both."""

    evaluation_id: str
    runner: str | None
    heartbeat_at: dt.datetime | None


def claims_under_way(session: Session) -> list[Claim]:
    """Every evaluation queued or running, with its holder (few: each tenant has a cap)."""
    rows = session.execute(select(Evaluation.id, Evaluation.runner, Evaluation.heartbeat_at)
                           .where(Evaluation.status.in_(UNDER_WAY)).order_by(Evaluation.created_at))
    return [Claim(*row) for row in rows]


def read_claim(session: Session, evaluation_id: str) -> Claim | None:
    row = session.execute(select(Evaluation.id, Evaluation.runner, Evaluation.heartbeat_at)
                          .where(Evaluation.id == evaluation_id, Evaluation.status.in_(UNDER_WAY))).first()
    return Claim(*row) if row is not None else None
