"""registered_models: base models admins register through POST /v1/models

Revision ID: 0209_registered_models
Revises: 0208_event_levels_and_types
Create Date: 2026-12-01 15:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import control.db.base

revision = "0209_registered_models"
down_revision = "0208_event_levels_and_types"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "registered_models",
        sa.Column("id", sa.String(256), nullable=False),
        sa.Column("source", sa.String(1024), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("path", sa.String(1024), nullable=True),
        sa.Column("architecture", sa.String(32), nullable=True),
        sa.Column("max_seq_len", sa.Integer(), nullable=True),
        sa.Column("params_b", sa.Float(), nullable=True),
        sa.Column("hf_id", sa.String(256), nullable=True),
        sa.Column("revision", sa.String(256), nullable=True),
        sa.Column("commit_sha", sa.String(64), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("created_by", sa.String(64), nullable=False),
        sa.Column("created_at", control.db.base.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_registered_models")),
    )


def downgrade() -> None:
    op.drop_table("registered_models")
