"""jobs.restart_not_before: a requeued lost run waits out its restart backoff

Revision ID: 0211_restart_backoff
Revises: 0210_awaiting_start
Create Date: 2026-12-01 20:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import control.db.base

revision = "0211_restart_backoff"
down_revision = "0210_awaiting_start"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("restart_not_before", control.db.base.UTCDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("restart_not_before")
