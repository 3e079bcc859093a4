"""``/v1/fine_tuning/jobs``: create, list, retrieve, cancel, pause, resume, events, checkpoints."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.routing import APIRoute

from api.deps import (
    BaseModelsDep,
    CurrentKey,
    CurrentTenant,
    JobPagesDep,
    NodePoolsDep,
    QueueDep,
    SessionDep,
    SettingsDep,
)
from api.errors import error_responses
from api.fleet.estimate import estimate_job
from api.jobs import commands, queries
from api.jobs.schemas import (
    CheckpointPublic,
    CheckpointsPublic,
    JobCreate,
    JobEventPublic,
    JobEventsPublic,
    JobPublic,
    JobsPublic,
)
from api.jobs.trackers import check_tracking_uris
from api.schemas.common import PageAfter, PageLimit
from control.errors import APIError

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])

_METADATA_PARAM = re.compile(r"^metadata\[(.+)\]$")


@router.post("", response_model=JobPublic, responses=error_responses(409))
def create_job(
    body: JobCreate, session: SessionDep, tenant: CurrentTenant, queue: QueueDep,
    settings: SettingsDep, base_models: BaseModelsDep, pools: NodePoolsDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JobPublic:
    """Create a fine-tuning job (OpenAI body + tunefleet extensions)."""
    check_tracking_uris(body.integrations, settings)
    commands.check_reinforcement(session, tenant.id, settings, base_models, body)
    job = commands.create_job(
        session, tenant, body, raw_body=body.model_dump(mode="json", exclude_unset=True),
        base_models=base_models, settings=settings, queue=queue, idempotency_key=idempotency_key,
        estimate=lambda job: estimate_job(session, job, base_models=base_models, pools=pools),
    )
    return JobPublic.of(job)


@router.get("", response_model=JobsPublic)
def list_jobs(
    request: Request, session: SessionDep, tenant: CurrentTenant, pages: JobPagesDep,
    after: PageAfter = None, limit: PageLimit = 20,
    status: Annotated[str | None, Query(description="Only jobs in this status.")] = None,
) -> Response:
    """List jobs newest first; filter with ``metadata[key]=value`` (repeatable) and ``status``."""
    metadata: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        match = _METADATA_PARAM.match(name)
        if match:
            metadata[match.group(1)] = value
        elif name.startswith("metadata"):
            raise APIError(400, "invalid_request", "Filter metadata as metadata[key]=value.",
                           param=name)
    # Serialized by list_jobs_json, straight from the rows (or reused while the tenant's
    # jobs are unchanged): FastAPI would validate the page against response_model and
    # encode it again through jsonable_encoder + json.dumps, which costs more than the
    # query (response_model still documents the shape).
    body = queries.list_jobs_json(session, tenant, after=after, limit=limit, metadata=metadata,
                                  status=status, pages=pages,
                                  query=request.scope["query_string"])
    session.close()  # give the connection back from this thread: get_session needs no hop then
    return Response(body, media_type="application/json")


def list_route() -> APIRoute:
    """The ``GET`` list route (``api.jobs.pages.CachedJobListMiddleware`` answers for it)."""
    return next(r for r in router.routes if isinstance(r, APIRoute) and r.endpoint is list_jobs)


@router.get("/{job_id}", response_model=JobPublic, responses=error_responses(404))
def retrieve_job(job_id: str, session: SessionDep, key: CurrentKey) -> JobPublic:
    return JobPublic.of(queries.get_job(session, key, job_id))


@router.post("/{job_id}/cancel", response_model=JobPublic, responses=error_responses(404, 409))
def cancel_job(job_id: str, session: SessionDep, key: CurrentKey, queue: QueueDep) -> JobPublic:
    return JobPublic.of(commands.cancel_job(session, key, job_id, queue=queue))


@router.post("/{job_id}/pause", response_model=JobPublic, responses=error_responses(404, 409))
def pause_job(job_id: str, session: SessionDep, key: CurrentKey, queue: QueueDep) -> JobPublic:
    return JobPublic.of(commands.pause_job(session, key, job_id, queue=queue))


@router.post("/{job_id}/resume", response_model=JobPublic, responses=error_responses(404, 409))
def resume_job(job_id: str, session: SessionDep, key: CurrentKey, queue: QueueDep) -> JobPublic:
    return JobPublic.of(commands.resume_job(session, key, job_id, queue=queue))


@router.get("/{job_id}/events", response_model=JobEventsPublic, responses=error_responses(404))
def list_events(
    job_id: str, session: SessionDep, key: CurrentKey, after: PageAfter = None,
    limit: PageLimit = 20,
) -> JobEventsPublic:
    job = queries.get_job(session, key, job_id)
    rows, has_more = queries.list_events(session, job, after=after, limit=limit)
    data = [JobEventPublic.of(e) for e in rows]
    return JobEventsPublic.page(data, has_more=has_more)


@router.get("/{job_id}/checkpoints", response_model=CheckpointsPublic,
            responses=error_responses(404))
def list_checkpoints(
    job_id: str, session: SessionDep, key: CurrentKey, after: PageAfter = None,
    limit: PageLimit = 10,
) -> CheckpointsPublic:
    job = queries.get_job(session, key, job_id)
    rows, has_more = queries.list_checkpoints(session, job, after=after, limit=limit)
    data = [CheckpointPublic.of(c, job) for c in rows]
    return CheckpointsPublic.page(data, has_more=has_more)
