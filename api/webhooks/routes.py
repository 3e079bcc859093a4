"""``/v1/webhooks``: endpoint CRUD, secret rotation and the delivery log (tenant-scoped).

Another tenant's endpoint is a 404, like every object in this API. Target URLs are
checked when saved (``urls.check_target_url``); a refused URL is a 400 with
``param: "url"`` and the code ``invalid_webhook_url``, ``webhook_url_not_public`` or
``webhook_url_unresolvable``.
"""

from __future__ import annotations

import datetime as dt

from fastapi import APIRouter
from sqlalchemy import select

from api.deps import CurrentTenant, SessionDep, SettingsDep
from api.errors import error_responses
from api.pagination import page_newest_first
from api.schemas.common import PageAfter, PageLimit
from api.webhooks.schemas import (
    DeliveriesPublic,
    DeliveryPublic,
    RotateSecret,
    WebhookCreate,
    WebhookDeleted,
    WebhookPublic,
    WebhooksPublic,
    WebhookUpdate,
)
from control.db.base import utcnow
from control.errors import APIError, not_found
from control.ids import new_id
from control.settings import get_settings
from control.webhooks.models import WebhookDelivery, WebhookEndpoint
from control.webhooks.sealing import seal
from control.webhooks.signing import generate_secret
from control.webhooks.urls import TargetURLError, check_target_url

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])


def _checked_url(url: str) -> str:
    # The webhook settings are the process's (``get_settings``), as the worker's delivery
    # task reads them, so that both sides apply the same target rules.
    try:
        settings = get_settings()
        return check_target_url(url, allow_private=settings.webhook_allow_private,
                                allowed_hosts=settings.webhook_allowed_hosts)
    except TargetURLError as exc:
        raise APIError(400, exc.code, exc.message, param="url") from None


def _get_endpoint(session: SessionDep, tenant_id: str, endpoint_id: str) -> WebhookEndpoint:
    row = session.get(WebhookEndpoint, endpoint_id)
    if row is None or row.tenant_id != tenant_id or row.deleted_at is not None:
        raise not_found("webhook endpoint", endpoint_id)
    return row


@router.post("", response_model=WebhookPublic)
def create_webhook(body: WebhookCreate, session: SessionDep, tenant: CurrentTenant,
                   settings: SettingsDep) -> WebhookPublic:
    secret = generate_secret()
    row = WebhookEndpoint(
        id=new_id("whep"), tenant_id=tenant.id, url=_checked_url(body.url), description=body.description,
        events=list(dict.fromkeys(body.events)), enabled=body.enabled,
        secret=seal(secret, settings.secret_key_value()),
    )
    session.add(row)
    session.commit()
    return WebhookPublic.of(row, secret=secret)


@router.get("", response_model=WebhooksPublic)
def list_webhooks(session: SessionDep, tenant: CurrentTenant, limit: PageLimit = 20,
                  after: PageAfter = None) -> WebhooksPublic:
    query = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant.id,
                                          WebhookEndpoint.deleted_at.is_(None))
    rows, has_more = page_newest_first(session, query, WebhookEndpoint, after=after, limit=limit)
    data = [WebhookPublic.of(r) for r in rows]
    return WebhooksPublic.page(data, has_more=has_more)


@router.get("/{endpoint_id}", response_model=WebhookPublic, responses=error_responses(404))
def get_webhook(endpoint_id: str, session: SessionDep, tenant: CurrentTenant) -> WebhookPublic:
    return WebhookPublic.of(_get_endpoint(session, tenant.id, endpoint_id))


@router.patch("/{endpoint_id}", response_model=WebhookPublic, responses=error_responses(404))
def update_webhook(endpoint_id: str, body: WebhookUpdate, session: SessionDep,
                   tenant: CurrentTenant) -> WebhookPublic:
    row = _get_endpoint(session, tenant.id, endpoint_id)
    if body.url is not None:
        row.url = _checked_url(body.url)
    if body.events is not None:
        row.events = list(dict.fromkeys(body.events))
    if body.description is not None:
        row.description = body.description
    if body.enabled is not None:
        row.enabled = body.enabled
    session.commit()
    return WebhookPublic.of(row)


@router.delete("/{endpoint_id}", response_model=WebhookDeleted, responses=error_responses(404))
def delete_webhook(endpoint_id: str, session: SessionDep, tenant: CurrentTenant) -> WebhookDeleted:
    row = _get_endpoint(session, tenant.id, endpoint_id)
    # Soft delete: the delivery log stays readable to operators; pending ones stop.
    row.deleted_at = utcnow()
    row.enabled = False
    session.commit()
    return WebhookDeleted(id=row.id)


@router.post("/{endpoint_id}/rotate_secret", response_model=WebhookPublic, responses=error_responses(404))
def rotate_secret(endpoint_id: str, session: SessionDep, tenant: CurrentTenant, settings: SettingsDep,
                  body: RotateSecret | None = None) -> WebhookPublic:
    """New secret now; the old one keeps signing (a second signature) for the grace period,
    so receivers can switch without dropping events."""
    row = _get_endpoint(session, tenant.id, endpoint_id)
    grace = get_settings().webhook_rotation_grace_s
    if body is not None and body.grace_period_s is not None:
        grace = body.grace_period_s
    row.previous_secret = row.secret if grace > 0 else None
    row.previous_secret_expires_at = utcnow() + dt.timedelta(seconds=grace) if grace > 0 else None
    secret = generate_secret()
    row.secret = seal(secret, settings.secret_key_value())
    session.commit()
    return WebhookPublic.of(row, secret=secret)


@router.get("/{endpoint_id}/deliveries", response_model=DeliveriesPublic, responses=error_responses(404))
def list_deliveries(endpoint_id: str, session: SessionDep, tenant: CurrentTenant,
                    limit: PageLimit = 20, after: PageAfter = None) -> DeliveriesPublic:
    _get_endpoint(session, tenant.id, endpoint_id)
    query = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id)
    rows, has_more = page_newest_first(session, query, WebhookDelivery, after=after, limit=limit)
    data = [DeliveryPublic.of(r) for r in rows]
    return DeliveriesPublic.page(data, has_more=has_more)
