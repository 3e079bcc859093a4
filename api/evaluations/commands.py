"""What writes held-out evaluations: a new one (every check first), and its runner's claim,
progress, outcome and release.

A new evaluation is refused, writing nothing, when:

- the job has not succeeded (409 ``job_not_succeeded``): only a finished job has a
  fine-tuned model to compare with its base;
- no file is named and the job has no validation file (400 ``invalid_request``);
- the file is not the job organization's (404, ``param`` ``file``), is still being
  validated (400 ``file_not_ready``), failed validation or is preference data, which has
  no single reference answer (400 ``invalid_file``);
- ``max_samples`` is over ``TUNEFLEET_EVALUATION_MAX_SAMPLES`` (400 ``too_many_samples``);
- the grader is refused as reinforcement fine-tuning refuses it (its codes, ``param``
  under ``grader``), or reads ``{{item.<key>}}`` that not every line of a reinforcement
  file has (400 ``grader_item_missing``);
- the job's base or fine-tuned model is no longer served (404 ``model_not_found``);
- the organization has ``TUNEFLEET_EVALUATION_MAX_CONCURRENT_PER_TENANT`` evaluations
  queued or running (429 ``too_many_evaluations``), counted under a lock on its row so
  that concurrent requests cannot pass it together.

Claims: the creating API process holds a new evaluation (``runner``, ``heartbeat_at``).
A runner takes an evaluation only by comparing the holder it read (runner and heartbeat
both), so two API processes never run one evaluation; each later write checks that the
runner still holds it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from api.evaluations.queries import UNDER_WAY, Claim, under_way
from api.evaluations.results import summary
from api.evaluations.rows import EVALUATED_FORMATS
from api.evaluations.schemas import DEFAULT_GRADER, EvaluationCreate
from api.files.queries import get_file
from api.graders.model_chat import resolve_grader_models
from api.graders.running import checked_grader
from api.inference.served_models import resolve_served_model
from control.db.base import utcnow
from control.db.models import Evaluation, Job, Tenant
from control.db.session import begin_write
from control.errors import APIError
from control.ids import new_id
from control.jobs.lifecycle import add_event
from control.models.base_models import BaseModelRegistry
from control.settings import Settings
from trainers.common.graders.models import item_references

TOO_MANY_RETRY_AFTER_S = 30


def create_evaluation(session: Session, job: Job, body: EvaluationCreate, settings: Settings,
                      base_models: BaseModelRegistry, runner: str) -> Evaluation:
    """A new ``queued`` evaluation of ``job`` held by ``runner``, or the 4xx of the first
    check it fails (see the module doc); the caller commits."""
    if job.status != "succeeded" or not job.fine_tuned_model:
        raise APIError(409, "job_not_succeeded",
                       f"Job '{job.id}' is {job.status}: only a succeeded job's fine-tuned model can be evaluated.")
    tenant = session.get_one(Tenant, job.tenant_id)
    file_id = body.file or job.validation_file
    if file_id is None:
        raise APIError(400, "invalid_request", f"Job '{job.id}' has no validation file: name the file to evaluate.",
                       param="file")
    file = get_file(session, tenant, file_id, param="file")
    report = file.validation or {}
    if file.status == "uploaded":
        raise APIError(400, "file_not_ready", f"File '{file.id}' is still being validated; retry when it is "
                       "processed.", param="file")
    if file.status != "processed":
        raise APIError(400, "invalid_file", f"File '{file.id}' failed validation: {file.status_details}",
                       param="file")
    if report.get("format") not in EVALUATED_FORMATS:
        raise APIError(400, "invalid_file", f"File '{file.id}' holds {report.get('format')} rows, which have no "
                       "single reference answer; evaluate a chat (or other supervised) or reinforcement file.",
                       param="file")
    limit = settings.evaluation_max_samples
    if body.max_samples is not None and body.max_samples > limit:
        raise APIError(400, "too_many_samples", f"max_samples is {body.max_samples}; an evaluation grades at most "
                       f"{limit} rows (TUNEFLEET_EVALUATION_MAX_SAMPLES).", param="max_samples")
    rows = min(body.max_samples or limit, limit, int(report.get("n_examples") or 0))
    grader_json = body.grader if body.grader is not None else DEFAULT_GRADER
    grader = checked_grader(grader_json)
    resolve_grader_models(session, tenant.id, settings, base_models, grader)
    _check_item_keys(grader, report, file.id)
    for model in (job.model, job.fine_tuned_model):
        try:
            resolve_served_model(session, tenant.id, settings, base_models, model)
        except APIError as exc:
            raise APIError(exc.status, exc.code, f"{exc.message} It cannot be evaluated.") from exc
    begin_write(session)
    session.scalar(select(Tenant.id).where(Tenant.id == tenant.id).with_for_update())
    running = under_way(session, tenant.id)
    if running >= settings.evaluation_max_concurrent_per_tenant:
        raise APIError(429, "too_many_evaluations",
                       f"This organization has {running} evaluations queued or running (at most "
                       f"{settings.evaluation_max_concurrent_per_tenant} at once); retry after "
                       f"{TOO_MANY_RETRY_AFTER_S} s.", headers={"Retry-After": str(TOO_MANY_RETRY_AFTER_S)})
    row = Evaluation(id=new_id("fteval"), job_id=job.id, tenant_id=tenant.id, file_id=file.id, grader=grader_json,
                     max_samples=rows, max_tokens=body.max_tokens, status="queued", rows_total=2 * rows,
                     runner=runner, heartbeat_at=utcnow())
    session.add(row)
    session.flush()
    return row


def _check_item_keys(grader: Any, report: dict[str, Any], file_id: str) -> None:
    """A reinforcement file's lines have no reference: the grader must read what they all hold."""
    keys = report.get("item_keys")
    if report.get("format") != "reinforcement" or keys is None:
        return
    for key, where in item_references(grader):
        if key not in keys:
            raise APIError(400, "grader_item_missing",
                           f"The grader reads {{{{item.{key}}}}} ({where}), but not every line of file '{file_id}' "
                           f"has a '{key}' key (reinforcement lines have no reference answer); the keys every line "
                           f"has: {', '.join(keys)}.", param=where)


def claim(session: Session, seen: Claim, runner: str, now: dt.datetime) -> bool:
    """Take the evaluation for ``runner`` if its holder is still the one ``seen``; a new run
    starts from its first row."""
    result = session.execute(
        update(Evaluation)
        .where(Evaluation.id == seen.evaluation_id, Evaluation.status.in_(UNDER_WAY),
               Evaluation.runner.is_not_distinct_from(seen.runner),
               Evaluation.heartbeat_at.is_not_distinct_from(seen.heartbeat_at))
        .values(runner=runner, heartbeat_at=now, status="running", attempts=Evaluation.attempts + 1, rows_done=0,
                started_at=now)
        .execution_options(synchronize_session=False))
    return result.rowcount == 1  # type: ignore[attr-defined]


def heartbeat(session: Session, evaluation_id: str, runner: str, answered: int, now: dt.datetime) -> bool:
    """Renew ``runner``'s claim and record its progress; False once it no longer holds it."""
    result = session.execute(
        update(Evaluation).where(Evaluation.id == evaluation_id, Evaluation.runner == runner,
                                 Evaluation.status == "running")
        .values(heartbeat_at=now, rows_done=answered).execution_options(synchronize_session=False))
    return result.rowcount == 1  # type: ignore[attr-defined]


def finish(session: Session, evaluation_id: str, runner: str, *, results: dict[str, Any] | None = None,
           samples: list[dict[str, Any]] | None = None, error: dict[str, str] | None = None) -> bool:
    """Record the outcome of ``runner``'s run (``succeeded`` with results, else ``failed``
    with ``error``) and the job's event; False (nothing written) if it no longer holds it."""
    begin_write(session)
    row = session.scalar(select(Evaluation).where(Evaluation.id == evaluation_id).with_for_update())
    if row is None or row.runner != runner or row.status not in UNDER_WAY:
        return False
    if error is not None:
        fail(session, row, **error)
    else:
        _succeed(session, row, results or {}, samples or [])
    return True


def _succeed(session: Session, row: Evaluation, results: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    row.status, row.results, row.samples = "succeeded", results, samples
    row.rows_done, row.runner, row.heartbeat_at, row.finished_at = row.rows_total, None, None, utcnow()
    job = session.get_one(Job, row.job_id)
    text = summary(row.grader, results, from_parent=job.model != job.base_model)
    add_event(session, job, f"{text} ({row.id}, {row.file_id})",
              data={"evaluation": row.id, "file": row.file_id, "results": results})


def fail(session: Session, row: Evaluation, code: str, message: str) -> None:
    """Mark ``row`` failed with ``{code, message}`` and say so on its job."""
    row.status, row.error = "failed", {"code": code, "message": message}
    row.runner, row.heartbeat_at, row.finished_at = None, None, utcnow()
    add_event(session, session.get_one(Job, row.job_id), f"Held-out evaluation {row.id} failed: {code}: {message}",
              level="error", data={"evaluation": row.id, "file": row.file_id, "error": row.error})


def release(session: Session, runner: str) -> int:
    """Give back every evaluation ``runner`` holds (its API process stops): queued again,
    unheld, for the next process to take at once."""
    result = session.execute(
        update(Evaluation).where(Evaluation.runner == runner, Evaluation.status.in_(UNDER_WAY))
        .values(status="queued", runner=None, heartbeat_at=None, rows_done=0)
        .execution_options(synchronize_session=False))
    return result.rowcount  # type: ignore[attr-defined]
