"""Shared FastAPI dependencies as ``Annotated`` aliases: session, app state, auth.

Routes reach what ``api.main.create_app`` put on ``app.state`` only through these aliases
(``SettingsDep``, ``BaseModelsDep``, ``NodePoolsDep``...), never ``request.app.state``: a
route's signature then says everything it uses.

The cheap dependencies are ``async def`` on purpose: FastAPI runs every plain ``def``
dependency in the threadpool, one thread hop each, and on a hot route such as
``GET /v1/fine_tuning/jobs`` those hops cost more than the work. Only what blocks (the
database) goes to the threadpool: the session is created in the event loop (no
connection is taken until first use) and closed in a worker thread (inline when it holds
no connection, e.g. the list route closed it in its own thread); authentication is
answered from the key cache when it can and only goes to the threadpool when it needs
the database.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, Header, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from api.evaluations.runner import EvaluationRunner
from api.jobs.pages import JobPageCache
from api.outputs.stream import StreamSlots
from api.rate_limits import mark_verified
from api.ui.session import session_api_key
from control.artifacts import ArtifactStore
from control.auth import authenticate, authenticate_cached
from control.db.models import ApiKey, Tenant
from control.errors import APIError
from control.models.base_models import BaseModelRegistry
from control.queue import TaskQueue
from control.settings import Settings
from scheduling.pools import NodePool


async def get_session(request: Request) -> AsyncIterator[Session]:
    session: Session = request.app.state.session_factory()
    try:
        yield session
    finally:
        if session.in_transaction():
            # Closing returns the connection to the pool (a rollback round trip): off the loop.
            await run_in_threadpool(session.close)
        else:
            session.close()  # no connection held (or the route closed it): no I/O, no hop


def app_state(name: str) -> Any:
    """A dependency on ``app.state.<name>`` (set by ``api.main.create_app``)."""

    async def read(request: Request) -> Any:
        return getattr(request.app.state, name)

    read.__name__ = f"get_{name}"
    return Depends(read)


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, app_state("settings")]
QueueDep = Annotated[TaskQueue, app_state("queue")]
StoreDep = Annotated[ArtifactStore, app_state("store")]  # job artifacts and checkpoints
FileStoreDep = Annotated[ArtifactStore, app_state("file_store")]  # uploaded files
BaseModelsDep = Annotated[BaseModelRegistry, app_state("base_models")]
NodePoolsDep = Annotated[list[NodePool], app_state("node_pools")]
JobPagesDep = Annotated[JobPageCache, app_state("job_pages")]
EngineDep = Annotated[Engine, app_state("engine")]
StartedAtDep = Annotated[int, app_state("started_at")]  # Unix seconds the app was built at
SessionFactoryDep = Annotated[sessionmaker[Session], app_state("session_factory")]
StreamSlotsDep = Annotated[StreamSlots, app_state("stream_slots")]  # open job streams (caps)
EvaluationsDep = Annotated[EvaluationRunner, app_state("evaluations")]  # held-out evaluations under way


async def get_current_key(
    request: Request,
    session: SessionDep,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> ApiKey:
    """The request's API key, with its ``tenant`` loaded (no lazy load happens later).

    The rate limits then count the request against this key's budget (``mark_verified``).
    """
    key = authenticate_cached(session, authorization) if authorization is not None else None
    if key is None:
        key = await run_in_threadpool(_key_from_database, request, session, authorization)
    mark_verified(request.scope, ("key", key.prefix))
    return key


def _key_from_database(request: Request, session: Session, authorization: str | None) -> ApiKey:
    if authorization is None and (key := session_api_key(session, request)) is not None:
        key.tenant  # noqa: B018 - load it here, in the thread, not later in the event loop
        return key  # the dashboard's signed session cookie (api/ui/session.py)
    return authenticate(session, authorization)


CurrentKey = Annotated[ApiKey, Depends(get_current_key)]


async def get_current_tenant(key: CurrentKey) -> Tenant:
    return key.tenant


CurrentTenant = Annotated[Tenant, Depends(get_current_tenant)]


async def require_admin(key: CurrentKey) -> ApiKey:
    if not key.grants_admin:
        raise APIError(403, "permission_denied", "This route needs an admin API key.")
    return key


AdminDep = Annotated[ApiKey, Depends(require_admin)]
