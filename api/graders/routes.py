"""``POST /v1/fine_tuning/alpha/graders/validate`` and ``/run``: OpenAI's grader endpoints.

``validate`` answers the grader as given once it passes every check the trainers apply;
``run`` grades one ``model_sample`` against one ``item`` (``api.graders.running``).
Both authenticate with an API key and count against its rate limit like every ``/v1``
route.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from api.deps import BaseModelsDep, CurrentTenant, SessionDep, SettingsDep
from api.errors import error_responses
from api.graders.running import run_grader, validate_grader
from api.graders.schemas import (
    GraderRunRequest,
    GraderRunResponse,
    GraderValidateRequest,
    GraderValidateResponse,
)

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["graders"])


@router.post("/validate", response_model=GraderValidateResponse, responses=error_responses(400))
async def validate(body: GraderValidateRequest, session: SessionDep, tenant: CurrentTenant, settings: SettingsDep,
                   base_models: BaseModelsDep) -> dict[str, Any]:
    """Validate a grader (OpenAI's ``fine_tuning.alpha.graders.validate``)."""
    return await run_in_threadpool(validate_grader, session, tenant.id, settings, base_models, body.grader)


@router.post("/run", response_model=GraderRunResponse, responses=error_responses(400, 429))
async def run(body: GraderRunRequest, request: Request, session: SessionDep, tenant: CurrentTenant,
              settings: SettingsDep, base_models: BaseModelsDep) -> dict[str, Any]:
    """Run a grader on one sample (OpenAI's ``fine_tuning.alpha.graders.run``)."""
    return await run_grader(request, session, tenant.id, settings, base_models, body.grader, body.model_sample,
                            body.item)
