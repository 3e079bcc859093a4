"""Held-out evaluations of a succeeded job: its base and its fine-tuned model answer the
rows of a file, graded by one grader (default: exact match), in the background.

``POST /v1/fine_tuning/jobs/{id}/evaluations``   start one (answered ``queued``)
``GET  /v1/fine_tuning/jobs/{id}/evaluations``   the job's evaluations, newest first
``GET  /v1/fine_tuning/jobs/{id}/evaluations/{evaluation id}``   one of them

The checks are ``api.evaluations.commands``'s; the run is ``api.evaluations.runner``'s.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from api.deps import BaseModelsDep, CurrentKey, EvaluationsDep, SessionDep, SettingsDep
from api.errors import error_responses
from api.evaluations.commands import create_evaluation
from api.evaluations.queries import get_evaluation, job_evaluations
from api.evaluations.schemas import EvaluationCreate, EvaluationPublic, EvaluationsPublic
from api.jobs.queries import get_job
from api.schemas.common import PageAfter, PageLimit
from control.db.models import ApiKey
from control.models.base_models import BaseModelRegistry
from control.settings import Settings

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning evaluations"])


@router.post("/{job_id}/evaluations", response_model=EvaluationPublic,
             responses=error_responses(400, 404, 409, 429))
async def create(job_id: str, body: EvaluationCreate, session: SessionDep, key: CurrentKey, settings: SettingsDep,
                 base_models: BaseModelsDep, evaluations: EvaluationsDep) -> EvaluationPublic:
    """Evaluate the job's base and fine-tuned models on a file's rows, in the background.

    Answered ``queued`` at once; poll the evaluation (or the list) until it has ``succeeded``
    (``results``, ``samples``) or ``failed`` (``error``). The job gets an event when it ends.
    """
    evaluation = await run_in_threadpool(_create, session, key, job_id, body, settings, base_models,
                                         evaluations.name)
    evaluations.start(evaluation.id)
    return evaluation


def _create(session: Session, key: ApiKey, job_id: str, body: EvaluationCreate, settings: Settings,
            base_models: BaseModelRegistry, runner: str) -> EvaluationPublic:
    job = get_job(session, key, job_id)
    row = create_evaluation(session, job, body, settings, base_models, runner)
    session.commit()
    return EvaluationPublic.of(row)


@router.get("/{job_id}/evaluations", response_model=EvaluationsPublic, responses=error_responses(400, 404))
def list_evaluations(job_id: str, session: SessionDep, key: CurrentKey, after: PageAfter = None,
                     limit: PageLimit = 20) -> EvaluationsPublic:
    """The job's evaluations, newest first."""
    rows, has_more = job_evaluations(session, get_job(session, key, job_id), after=after, limit=limit)
    return EvaluationsPublic.page([EvaluationPublic.of(row) for row in rows], has_more=has_more)


@router.get("/{job_id}/evaluations/{evaluation_id}", response_model=EvaluationPublic,
            responses=error_responses(404))
def retrieve_evaluation(job_id: str, evaluation_id: str, session: SessionDep, key: CurrentKey) -> EvaluationPublic:
    return EvaluationPublic.of(get_evaluation(session, get_job(session, key, job_id), evaluation_id))
