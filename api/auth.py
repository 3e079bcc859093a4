"""API-key authentication and tenant/key administration (used by routes and the CLI)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, joinedload

from api.db.base import utcnow
from api.db.models import ApiKey, Tenant
from api.errors import APIError
from api.ids import hash_secret, key_prefix, new_api_key, new_id


def authenticate(session: Session, authorization: str | None) -> ApiKey:
    """The live key named by an ``Authorization: Bearer`` header, else a 401."""
    if not authorization:
        raise APIError(
            401,
            "missing_api_key",
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            headers={"WWW-Authenticate": "Bearer"},
        )
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or key_prefix(token) is None:
        raise _invalid_key()
    # One round trip: the key and its tenant (every authenticated route needs both).
    key = session.scalar(
        select(ApiKey).options(joinedload(ApiKey.tenant)).where(ApiKey.key_hash == hash_secret(token))
    )
    if key is None or key.revoked_at is not None:
        raise _invalid_key()
    return key


def _invalid_key() -> APIError:
    return APIError(
        401, "invalid_api_key", "Incorrect API key provided.", headers={"WWW-Authenticate": "Bearer"}
    )


def create_tenant(session: Session, name: str, *, is_admin: bool = False) -> Tenant:
    """A new tenant (``org-…``); names are unique."""
    if session.scalar(select(Tenant).where(Tenant.name == name)) is not None:
        raise APIError(409, "tenant_exists", f"A tenant named '{name}' already exists.", param="name")
    tenant = Tenant(id=new_id("org"), name=name, is_admin=is_admin)
    session.add(tenant)
    session.flush()
    return tenant


def create_api_key(
    session: Session, tenant: Tenant, *, is_admin: bool = False, name: str | None = None,
    raw_key: str | None = None,
) -> tuple[ApiKey, str]:
    """A new key for ``tenant``; returns the row and the raw key (shown once, never stored).

    ``raw_key`` lets an operator install a key of their own (``TUNEFLEET_ADMIN_API_KEY``).
    """
    if raw_key is None:
        raw_key, prefix = new_api_key()
    else:
        prefix = key_prefix(raw_key) or raw_key[:8]
    key = ApiKey(
        id=new_id("key"), tenant=tenant, prefix=prefix, key_hash=hash_secret(raw_key),
        is_admin=is_admin, name=name,
    )
    session.add(key)
    session.flush()
    return key, raw_key


def revoke_api_key(session: Session, key: ApiKey) -> None:
    key.revoked_at = utcnow()
    session.flush()
