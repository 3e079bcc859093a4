"""Request/response shapes of ``/v1/webhooks`` (Create / Update / Public family)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, StringConstraints

from api.schemas.common import AcceptWholeFloats, ListPublic, Strict
from control.db.base import to_unix
from control.webhooks.events import EVENT_TYPES
from control.webhooks.models import WebhookDelivery, WebhookEndpoint

EventType = Literal[EVENT_TYPES]  # type: ignore[valid-type]
Url = Annotated[str, StringConstraints(min_length=8, max_length=2048)]
Description = Annotated[str, StringConstraints(max_length=512)]


class WebhookCreate(Strict):
    url: Url
    events: list[EventType] = Field(default_factory=list, max_length=len(EVENT_TYPES),
                                    description="Event types to receive; empty = all.")
    description: Description | None = None
    enabled: StrictBool = True


class WebhookUpdate(Strict):
    url: Url | None = None
    events: list[EventType] | None = None
    description: Description | None = None
    enabled: StrictBool | None = None


class RotateSecret(Strict):
    grace_period_s: Annotated[int, Field(strict=True, ge=0, le=7 * 86400), AcceptWholeFloats] | None = Field(
        default=None, description="Seconds the old secret keeps signing (default 24 h)."
    )


class WebhookPublic(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    events: list[str]
    description: str | None
    enabled: bool
    created_at: int
    previous_secret_expires_at: int | None
    secret: str | None = Field(default=None, description="Only in the create and rotate answers.")

    @classmethod
    def of(cls, row: WebhookEndpoint, *, secret: str | None = None) -> WebhookPublic:
        return cls(
            id=row.id, url=row.url, events=list(row.events or []), description=row.description,
            enabled=row.enabled, created_at=to_unix(row.created_at) or 0,
            previous_secret_expires_at=to_unix(row.previous_secret_expires_at),
            secret=secret,
        )


WebhooksPublic = ListPublic[WebhookPublic]


class WebhookDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    deleted: bool = True


class DeliveryPublic(BaseModel):
    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    endpoint_id: str
    event_id: str
    event_type: str
    job_id: str | None
    status: str
    attempts: int
    response_status: int | None
    last_error: str | None
    created_at: int
    last_attempt_at: int | None
    next_attempt_at: int | None
    delivered_at: int | None
    attempt_log: list[dict[str, Any]]

    @classmethod
    def of(cls, row: WebhookDelivery) -> DeliveryPublic:
        return cls(
            id=row.id, endpoint_id=row.endpoint_id, event_id=row.event_id, event_type=row.event_type,
            job_id=row.job_id, status=row.status, attempts=row.attempts, response_status=row.response_status,
            last_error=row.last_error, created_at=to_unix(row.created_at) or 0,
            last_attempt_at=to_unix(row.last_attempt_at), next_attempt_at=to_unix(row.next_attempt_at),
            delivered_at=to_unix(row.delivered_at), attempt_log=list(row.attempt_log or []),
        )


DeliveriesPublic = ListPublic[DeliveryPublic]
