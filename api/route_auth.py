"""Authentication answers before anything about the request's body.

FastAPI reads and decodes a JSON body before it solves a route's dependencies, so a
request without credentials but with a broken body would hear about its body (400)
instead of its missing key (401): that tells an anonymous caller how the route parses,
and it is not the order clients expect. ``authenticate_route`` runs the route's own
authentication dependency on such a request, and the error handlers
(``api.errors.install_error_handlers``) call it before they answer a body error.

``AUTHENTICATORS`` names the dependencies that authenticate and the statuses each can
answer; ``api.openapi`` documents those statuses on every route that depends on them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session

from api.deps import SessionDep, get_current_key, require_admin
from api.rate_limits import mark_verified
from control.reports.ingest import authenticate_job


def job_token(
    job_id: str, request: Request, session: SessionDep,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> None:
    """The report route's check: the bearer token is this job's (401, or 404 for another
    job's token). A route dependency, so it runs before the batch is validated. The rate
    limits then count the request against the job's report budget."""
    authenticate_job(session, job_id, authorization)
    mark_verified(request.scope, ("job", job_id))


# dependency -> the error statuses it answers with
AUTHENTICATORS: dict[Any, tuple[int, ...]] = {
    get_current_key: (401,),
    require_admin: (401, 403),
    job_token: (401, 404),
}


def route_authenticators(dependant: Dependant) -> Iterator[Any]:
    """The authenticating dependencies anywhere in ``dependant``'s tree."""
    for sub in dependant.dependencies:
        if sub.call in AUTHENTICATORS:
            yield sub.call
        yield from route_authenticators(sub)


async def authenticate_route(request: Request) -> None:
    """Raise the route's 401 (or 404) if the request does not authenticate; else return.

    Called on a request whose body could not be read as the route's input, before that
    error is answered. Routes without authentication (health, dashboard login) pass.
    """
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    checks = set(route_authenticators(route.dependant))
    if not checks:
        return
    authorization = request.headers.get("authorization")
    session: Session = request.app.state.session_factory()
    try:
        if job_token in checks:
            job_id = request.path_params.get("job_id", "")
            await run_in_threadpool(job_token, job_id, request, session, authorization)
        if get_current_key in checks or require_admin in checks:
            key = await get_current_key(request, session, authorization)
            if require_admin in checks:
                await require_admin(key)
    finally:
        await run_in_threadpool(session.close)
