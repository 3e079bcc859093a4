"""Tables of the webhook feature: endpoints and the delivery outbox/log.

A ``WebhookDelivery`` row is written in the same transaction as the job change it
reports (the outbox), holds the exact body that is signed on every attempt, and
doubles as the delivery log shown to users (attempts, last answer, per-attempt history).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import JSON, Boolean, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from control.db.base import Base, utcnow
from control.webhooks.sealing import unseal

DELIVERY_STATUSES = ("pending", "succeeded", "failed")


class WebhookEndpoint(Base):
    __tablename__ = "webhook_endpoints"
    __table_args__ = (Index("ix_webhook_endpoints_tenant_created", "tenant_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(String(2048))
    description: Mapped[str | None] = mapped_column(String(512))
    events: Mapped[list[Any]] = mapped_column(JSON, default=list, doc="Subscribed types; empty = all.")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    # Sealed (encrypted) with the service secret key: see control/webhooks/sealing.py.
    secret: Mapped[str] = mapped_column(String(512))
    previous_secret: Mapped[str | None] = mapped_column(String(512))
    previous_secret_expires_at: Mapped[dt.datetime | None]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    deleted_at: Mapped[dt.datetime | None]

    def signing_secrets(self, now: dt.datetime, service_key: str) -> list[str]:
        """The current secret, plus the previous one while its grace window lasts (unsealed).

        Raises:
            SecretUnreadable: the service secret key changed since the secret was sealed."""
        out = [unseal(self.secret, service_key)]
        if self.previous_secret and self.previous_secret_expires_at and now < self.previous_secret_expires_at:
            out.append(unseal(self.previous_secret, service_key))
        return out


class WebhookDelivery(Base):
    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_endpoint_created", "endpoint_id", "created_at", "id"),
        Index("ix_webhook_deliveries_status_next", "status", "next_attempt_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    event_id: Mapped[str] = mapped_column(String(64), doc="The payload's id and the webhook-id header.")
    event_type: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str | None] = mapped_column(String(64))
    body: Mapped[str] = mapped_column(Text, doc="Exact JSON sent (signed bytes are the same on retries).")
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[dt.datetime | None]
    last_attempt_at: Mapped[dt.datetime | None]
    response_status: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    attempt_log: Mapped[list[Any]] = mapped_column(JSON, default=list)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[dt.datetime | None]
