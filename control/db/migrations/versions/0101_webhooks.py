"""webhooks: endpoints and the delivery outbox/log

Revision ID: 0101_webhooks
Revises: 0001
Create Date: 2026-11-29 14:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import control.db.base

revision = "0101_webhooks"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Written by hand to match control/webhooks/models.py (checked by tests/integrations).
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("url", sa.String(length=2048), nullable=False),
        sa.Column("description", sa.String(length=512), nullable=True),
        sa.Column("events", sa.JSON(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("secret", sa.String(length=512), nullable=False),
        sa.Column("previous_secret", sa.String(length=512), nullable=True),
        sa.Column("previous_secret_expires_at", control.db.base.UTCDateTime(timezone=True), nullable=True),
        sa.Column("created_at", control.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.Column("updated_at", control.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", control.db.base.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_webhook_endpoints_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_endpoints")),
    )
    op.create_index("ix_webhook_endpoints_tenant_created", "webhook_endpoints",
                    ["tenant_id", "created_at", "id"], unique=False)
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("endpoint_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("event_id", sa.String(length=64), nullable=False),
        sa.Column("event_type", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", control.db.base.UTCDateTime(timezone=True), nullable=True),
        sa.Column("last_attempt_at", control.db.base.UTCDateTime(timezone=True), nullable=True),
        sa.Column("response_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("attempt_log", sa.JSON(), nullable=False),
        sa.Column("created_at", control.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", control.db.base.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["endpoint_id"], ["webhook_endpoints.id"],
                                name=op.f("fk_webhook_deliveries_endpoint_id_webhook_endpoints"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_webhook_deliveries_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
    )
    op.create_index("ix_webhook_deliveries_endpoint_created", "webhook_deliveries",
                    ["endpoint_id", "created_at", "id"], unique=False)
    op.create_index("ix_webhook_deliveries_status_next", "webhook_deliveries",
                    ["status", "next_attempt_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_status_next", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_endpoint_created", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index("ix_webhook_endpoints_tenant_created", table_name="webhook_endpoints")
    op.drop_table("webhook_endpoints")
