"""ui_revoked_sessions: dashboard sessions ended by logout before their cookie expires

Revision ID: 0205_ui_revoked_sessions
Revises: 0204_run_attempts
Create Date: 2026-12-01 11:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import control.db.base

revision = "0205_ui_revoked_sessions"
down_revision = "0204_run_attempts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ui_revoked_sessions",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("expires_at", control.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("session_id"),
    )


def downgrade() -> None:
    op.drop_table("ui_revoked_sessions")
