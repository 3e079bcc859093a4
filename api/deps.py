"""Shared FastAPI dependencies as ``Annotated`` aliases: session, settings, auth."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session

from api.artifacts import ArtifactStore
from api.auth import authenticate
from api.db.models import ApiKey, Tenant
from api.errors import APIError
from api.queue import TaskQueue
from api.settings import Settings
from api.ui.session import session_api_key


def get_session(request: Request) -> Iterator[Session]:
    session: Session = request.app.state.session_factory()
    try:
        yield session
    finally:
        session.close()


def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_queue(request: Request) -> TaskQueue:
    return request.app.state.queue


def get_store(request: Request) -> ArtifactStore:
    return request.app.state.store


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
QueueDep = Annotated[TaskQueue, Depends(get_queue)]
StoreDep = Annotated[ArtifactStore, Depends(get_store)]


def get_current_key(
    request: Request,
    session: SessionDep,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> ApiKey:
    if authorization is None and (key := session_api_key(session, request)) is not None:
        return key  # the dashboard's signed session cookie (api/ui/session.py)
    return authenticate(session, authorization)


CurrentKey = Annotated[ApiKey, Depends(get_current_key)]


def get_current_tenant(key: CurrentKey) -> Tenant:
    return key.tenant


CurrentTenant = Annotated[Tenant, Depends(get_current_tenant)]


def require_admin(key: CurrentKey) -> ApiKey:
    if not key.grants_admin:
        raise APIError(403, "permission_denied", "This route needs an admin API key.")
    return key


AdminDep = Annotated[ApiKey, Depends(require_admin)]
