"""Fleet routes: ``GET /v1/node_pools``, ``POST /v1/fine_tuning/estimate``, ``GET /v1/usage``.

Thin wrappers over ``api.fleet`` (pools, estimates) and ``api.usage``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from api import fleet
from api import usage as usage_queries
from api.deps import CurrentKey, CurrentTenant, SessionDep
from api.schemas.fleet import (
    EstimatePublic,
    EstimateRequest,
    NodePoolPublic,
    NodePoolsPublic,
    UsagePublic,
)

router = APIRouter(tags=["fleet"])


@router.get("/v1/node_pools", response_model=NodePoolsPublic)
def list_node_pools(request: Request, session: SessionDep, key: CurrentKey) -> NodePoolsPublic:
    """Pools with GPUs total/used/free now, running job ids (own tenant; admins: all), queue."""
    rows = fleet.pool_views(session, request.app.state.node_pools, key)
    data = [NodePoolPublic(**row) for row in rows]
    return NodePoolsPublic(
        data=data, first_id=data[0].name if data else None, last_id=data[-1].name if data else None
    )


@router.post("/v1/fine_tuning/estimate", response_model=EstimatePublic)
def estimate(
    body: EstimateRequest, request: Request, session: SessionDep, tenant: CurrentTenant
) -> EstimatePublic:
    """Memory per GPU, GPU count, tokens/s, ETA and cost per pool, and a dry run of placement."""
    result = fleet.estimate_request(
        session,
        tenant,
        body,
        base_models=request.app.state.base_models,
        pools=request.app.state.node_pools,
    )
    return EstimatePublic.model_validate(result)


@router.get("/v1/usage", response_model=UsagePublic)
def usage(
    session: SessionDep,
    key: CurrentKey,
    start: str | None = None,
    end: str | None = None,
    tenant: str | None = None,
) -> UsagePublic:
    """GPU-seconds and cost per pool in [start, end) (Unix seconds or ISO 8601); admins may pass
    ``tenant`` or get every tenant."""
    return UsagePublic.model_validate(
        usage_queries.usage_report(session, key, start=start, end=end, tenant=tenant)
    )
