"""The deployment's first tenant: the admin organization and its key, made at first start.

Every entry point that may be the first to start (``tunefleet serve``, the API started
straight from uvicorn by the Helm chart or the compose file) calls
:func:`ensure_admin_key`; it is idempotent.
"""

from __future__ import annotations

from sqlalchemy import select

from control.auth import create_api_key, create_tenant
from control.db.models import ApiKey, Tenant
from control.db.session import session_scope
from control.ids import hash_secret
from control.settings import Settings
from trainers.common.private_files import write_private_text

ADMIN_TENANT = "admin"


def ensure_admin_key(settings: Settings) -> str | None:
    """Make sure an admin tenant and key exist; return a new raw key, or None if one existed.

    With ``TUNEFLEET_ADMIN_API_KEY`` set, that key is installed (once). Otherwise a key is
    generated on first start; only its hash is stored in the database, and the raw key is
    written to ``<data>/admin_key`` (0600) so the operator can read it again.
    """
    wanted = settings.admin_api_key.get_secret_value() if settings.admin_api_key else None
    with session_scope(settings.resolved_database_url) as session:
        tenant = session.scalar(select(Tenant).where(Tenant.name == ADMIN_TENANT))
        if tenant is None:
            tenant = create_tenant(session, ADMIN_TENANT, is_admin=True)
        if wanted is not None:
            if session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_secret(wanted))):
                return None
            create_api_key(session, tenant, is_admin=True, name="TUNEFLEET_ADMIN_API_KEY",
                           raw_key=wanted)
            return wanted
        live = session.scalar(
            select(ApiKey).where(ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None))
        )
        if live is not None:
            return None
        _, raw = create_api_key(session, tenant, is_admin=True, name="first start")
    write_private_text(settings.data_path / "admin_key", raw + "\n")
    return raw
