"""files.expires_at: uploads that expire (OpenAI's expires_after) and the sweep's index

Revision ID: 0207_file_expiry
Revises: 0206_preference_metrics
Create Date: 2026-12-01 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import control.db.base

revision = "0207_file_expiry"
down_revision = "0206_preference_metrics"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("expires_at", control.db.base.UTCDateTime(timezone=True), nullable=True))
        batch.create_index("ix_files_expires_at", ["expires_at"])


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.drop_index("ix_files_expires_at")
        batch.drop_column("expires_at")
