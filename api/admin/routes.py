"""``/v1/admin``: tenants and API keys (admin keys only)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from sqlalchemy import select

from api.admin.schemas import (
    KeyCreate,
    KeyCreated,
    KeyPublic,
    TenantCreate,
    TenantPublic,
    TenantsPublic,
)
from api.deps import AdminDep, SessionDep
from api.errors import error_responses
from control import auth
from control.db.models import ApiKey, Tenant
from control.errors import not_found

router = APIRouter(prefix="/v1/admin", tags=["admin"])


@router.get("/tenants", response_model=TenantsPublic)
def list_tenants(session: SessionDep, _admin: AdminDep) -> dict[str, Any]:
    rows = session.scalars(select(Tenant).order_by(Tenant.created_at))
    return {"object": "list", "data": [auth.tenant_object(t) for t in rows]}


@router.post("/tenants", response_model=TenantPublic, responses=error_responses(409))
def create_tenant(body: TenantCreate, session: SessionDep, _admin: AdminDep) -> dict[str, Any]:
    tenant = auth.create_tenant(session, body.name, is_admin=body.is_admin)
    session.commit()
    return auth.tenant_object(tenant)


@router.post("/tenants/{tenant_id}/api_keys", response_model=KeyCreated,
             responses=error_responses(404))
def create_key(tenant_id: str, body: KeyCreate, session: SessionDep, _admin: AdminDep) -> dict[str, Any]:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise not_found("tenant", tenant_id)
    key, raw = auth.create_api_key(session, tenant, is_admin=body.is_admin, name=body.name)
    session.commit()
    return {**auth.key_object(key), "key": raw}


@router.delete("/api_keys/{key_id}", response_model=KeyPublic, responses=error_responses(404))
def revoke_key(key_id: str, session: SessionDep, _admin: AdminDep) -> dict[str, Any]:
    key = session.get(ApiKey, key_id)
    if key is None:
        raise not_found("API key", key_id)
    auth.revoke_api_key(session, key)
    session.commit()
    return auth.key_object(key)
