"""Admin schemas: tenants (``organization``) and API keys, as ``/v1/admin`` takes and shows them.

Booleans are strict: ``"is_admin": 0`` or ``"true"`` is a 400, not a quiet ``False``/``True``
on a field that grants every tenant's data.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictBool

from api.schemas.common import ListPublic, Strict


class TenantCreate(Strict):
    name: Annotated[str, Field(min_length=1, max_length=200)]
    is_admin: StrictBool = False


class KeyCreate(Strict):
    name: Annotated[str, Field(max_length=200)] | None = None
    is_admin: StrictBool = False


class TenantPublic(BaseModel):
    id: str
    object: Literal["organization"] = "organization"
    name: str
    is_admin: bool
    created_at: int | None


TenantsPublic = ListPublic[TenantPublic]


class KeyPublic(BaseModel):
    id: str
    object: Literal["api_key"] = "api_key"
    prefix: str = Field(description="The key's public prefix (what listings show).")
    name: str | None
    tenant_id: str
    is_admin: bool
    created_at: int | None
    revoked_at: int | None


class KeyCreated(KeyPublic):
    key: str = Field(description="The raw key; shown once, only its hash is stored.")
