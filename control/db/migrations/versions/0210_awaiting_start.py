"""jobs.awaiting_start_since: admitted onto a pool, the launch waiting for the cluster (Kueue)

Revision ID: 0210_awaiting_start
Revises: 0209_registered_models
Create Date: 2026-12-01 17:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import control.db.base

revision = "0210_awaiting_start"
down_revision = "0209_registered_models"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("awaiting_start_since", control.db.base.UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("awaiting_start_since")
