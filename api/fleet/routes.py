"""Fleet routes: ``GET /v1/node_pools``, ``POST /v1/fine_tuning/estimate``, ``GET /v1/usage``.

Thin wrappers over ``api.fleet.pools`` (pools), ``api.fleet.estimate`` (estimates) and ``api.fleet.usage``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import BaseModelsDep, CurrentKey, CurrentTenant, NodePoolsDep, SessionDep, SettingsDep
from api.errors import error_responses
from api.fleet import usage as usage_queries
from api.fleet.estimate import estimate_request
from api.fleet.pools import pool_views
from api.fleet.schemas import (
    EstimatePublic,
    EstimateRequest,
    NodePoolPublic,
    NodePoolsPublic,
    UsagePublic,
)

router = APIRouter(tags=["fleet"])

# What api.fleet.usage.parse_time reads: Unix seconds (a decimal number) or an ISO 8601 date or
# date-time (UTC without a zone). The pattern is checked before parsing, so the document
# and the server agree on the syntax; a well-formed but impossible date is still a 400.
TIME_PATTERN = (
    r"^(?:[0-9]{1,12}(?:\.[0-9]{1,9})?"
    r"|[0-9]{4}-[0-9]{2}-[0-9]{2}"
    r"(?:[T ][0-9]{2}:[0-9]{2}(?::[0-9]{2}(?:\.[0-9]{1,6})?)?(?:Z|[+-][0-9]{2}:[0-9]{2})?)?)$"
)
Time = Annotated[str | None, Query(
    pattern=TIME_PATTERN, max_length=40,
    description="Unix seconds (e.g. 1764423123) or ISO 8601 (2026-12-01, 2026-12-01T10:00:00Z).",
)]


@router.get("/v1/node_pools", response_model=NodePoolsPublic)
def list_node_pools(session: SessionDep, key: CurrentKey, pools: NodePoolsDep) -> NodePoolsPublic:
    """Pools with GPUs total/used/free now, running job ids (own tenant; admins: all), queue."""
    rows = pool_views(session, pools, key)
    data = [NodePoolPublic(**row) for row in rows]
    return NodePoolsPublic(
        data=data, first_id=data[0].name if data else "", last_id=data[-1].name if data else ""
    )


@router.post("/v1/fine_tuning/estimate", response_model=EstimatePublic)
def estimate(
    body: EstimateRequest, session: SessionDep, tenant: CurrentTenant,
    base_models: BaseModelsDep, pools: NodePoolsDep, settings: SettingsDep,
) -> EstimatePublic:
    """Memory per GPU, GPU count, tokens/s, ETA and cost per pool, and a dry run of placement."""
    result = estimate_request(session, tenant, body, base_models=base_models, pools=pools, settings=settings)
    return EstimatePublic.model_validate(result)


@router.get("/v1/usage", response_model=UsagePublic, responses=error_responses(403, 404))
def usage(
    session: SessionDep,
    key: CurrentKey,
    start: Time = None,
    end: Time = None,
    tenant: Annotated[str | None, Query(
        description="Admin keys: one tenant's usage (a tenant key may only name its own).",
    )] = None,
) -> UsagePublic:
    """GPU-seconds and cost per pool in [start, end) (Unix seconds or ISO 8601); admins may pass
    ``tenant`` or get every tenant."""
    return UsagePublic.model_validate(
        usage_queries.usage_report(session, key, start=start, end=end, tenant=tenant)
    )
