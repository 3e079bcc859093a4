"""``/v1/admin``: tenants and API keys (admin keys only)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import Field
from sqlalchemy import select

from api import auth
from api.db.base import to_unix
from api.db.models import ApiKey, Tenant
from api.deps import AdminDep, SessionDep
from api.errors import not_found
from api.schemas.common import Strict

router = APIRouter(prefix="/v1/admin", tags=["admin"])


class TenantCreate(Strict):
    name: Annotated[str, Field(min_length=1, max_length=200)]
    is_admin: bool = False


class KeyCreate(Strict):
    name: Annotated[str, Field(max_length=200)] | None = None
    is_admin: bool = False


def _tenant(t: Tenant) -> dict[str, Any]:
    return {"id": t.id, "object": "organization", "name": t.name, "is_admin": t.is_admin,
            "created_at": to_unix(t.created_at)}


def _key(k: ApiKey) -> dict[str, Any]:
    return {"id": k.id, "object": "api_key", "prefix": k.prefix, "name": k.name,
            "tenant_id": k.tenant_id, "is_admin": k.is_admin, "created_at": to_unix(k.created_at),
            "revoked_at": to_unix(k.revoked_at)}


@router.get("/tenants")
def list_tenants(session: SessionDep, _admin: AdminDep) -> dict[str, Any]:
    rows = session.scalars(select(Tenant).order_by(Tenant.created_at))
    return {"object": "list", "data": [_tenant(t) for t in rows]}


@router.post("/tenants")
def create_tenant(body: TenantCreate, session: SessionDep, _admin: AdminDep) -> dict[str, Any]:
    tenant = auth.create_tenant(session, body.name, is_admin=body.is_admin)
    session.commit()
    return _tenant(tenant)


@router.post("/tenants/{tenant_id}/api_keys")
def create_key(tenant_id: str, body: KeyCreate, session: SessionDep, _admin: AdminDep) -> dict[str, Any]:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise not_found("tenant", tenant_id)
    key, raw = auth.create_api_key(session, tenant, is_admin=body.is_admin, name=body.name)
    session.commit()
    return {**_key(key), "key": raw}


@router.delete("/api_keys/{key_id}")
def revoke_key(key_id: str, session: SessionDep, _admin: AdminDep) -> dict[str, Any]:
    key = session.get(ApiKey, key_id)
    if key is None:
        raise not_found("API key", key_id)
    auth.revoke_api_key(session, key)
    session.commit()
    return _key(key)
